"""`python data_tools/merge_datasets.py --help`: the same as the console script
`rembert-merge-datasets`. The command line lives in megatron_rembert/prep/commands.py."""

import sys

from megatron_rembert.prep.commands import merge_datasets

if __name__ == "__main__":
    sys.exit(merge_datasets())
