"""`python train.py --config configs/tiny.yaml [--set k=v ...]` from a checkout: the same as the
console script `rembert-train`. The command line lives in megatron_rembert/train.py."""

import sys

from megatron_rembert.train import main

if __name__ == "__main__":
    sys.exit(main())
