"""`python data_tools/make_libreoffice_corpus.py --help`: the same as the console script
`rembert-libreoffice-corpus`. The command line lives in megatron_rembert/prep/commands.py."""

import sys

from megatron_rembert.prep.commands import make_libreoffice_corpus

if __name__ == "__main__":
    sys.exit(make_libreoffice_corpus())
