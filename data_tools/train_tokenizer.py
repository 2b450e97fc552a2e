"""`python data_tools/train_tokenizer.py --help`: the same as the console script
`rembert-train-tokenizer`. The command line lives in megatron_rembert/prep/commands.py."""

import sys

from megatron_rembert.prep.commands import train_tokenizer

if __name__ == "__main__":
    sys.exit(train_tokenizer())
