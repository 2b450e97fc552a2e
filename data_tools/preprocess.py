"""`python data_tools/preprocess.py --help`: the same as the console script
`rembert-preprocess`. The command line lives in megatron_rembert/prep/commands.py."""

import sys

from megatron_rembert.prep.commands import preprocess

if __name__ == "__main__":
    sys.exit(preprocess())
