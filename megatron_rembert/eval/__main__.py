"""python -m megatron_rembert.eval: the `rembert-eval` command (eval/cli.py)."""

import sys

from megatron_rembert.eval.cli import main

if __name__ == "__main__":
    sys.exit(main())
