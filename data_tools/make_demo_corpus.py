"""`python data_tools/make_demo_corpus.py --help`: the same as the console script
`rembert-make-demo-corpus`. The command line lives in megatron_rembert/prep/commands.py."""

import sys

from megatron_rembert.prep.commands import make_demo_corpus

if __name__ == "__main__":
    sys.exit(make_demo_corpus())
