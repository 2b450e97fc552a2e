"""Write the synthetic multilingual demo corpus (8 languages, 8 scripts, Zipfian vocabularies,
fixed word orders). Deterministic and offline. Example:

    python data_tools/make_demo_corpus.py --out demo_out/corpus --size-mb 4
"""

import argparse
import sys

import _path  # noqa: F401

from megatron_rembert.cli import run_cli
from megatron_rembert.fs import unwritable_reason
from megatron_rembert.prep.demo_corpus import LANGUAGES, make_demo_corpus


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


def _main(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output corpus folder (DIR/<lang>/...)")
    p.add_argument("--size-mb", type=float, default=4.0, help="total size of the text (MB)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--languages", nargs="*", choices=[x.code for x in LANGUAGES],
                   help="subset of languages (default: all)")
    args = p.parse_args(argv)
    if reason := unwritable_reason(args.out):
        p.error(f"--out {args.out}: {reason}")
    docs = make_demo_corpus(args.out, args.size_mb, args.seed, args.languages)
    for lang, n in docs.items():
        print(f"{lang:8s} {n:8,d} documents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
