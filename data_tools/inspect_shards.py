"""`python data_tools/inspect_shards.py --help`: the same as the console script
`rembert-inspect-shards`. The command line lives in megatron_rembert/prep/commands.py."""

import sys

from megatron_rembert.prep.commands import inspect_shards

if __name__ == "__main__":
    sys.exit(inspect_shards())
