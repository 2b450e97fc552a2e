"""Train the SentencePiece unigram tokenizer (RemBERT's kind) on a corpus folder.

Text is sampled per language with probability proportional to n_l^alpha, so small languages
are covered. Writes PREFIX.model, PREFIX.vocab and PREFIX.json (special ids
[PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4, the model's sha256, per-language sampling).

The same corpus and settings (--threads included) give a byte-identical .model. A rerun whose
tokenizer already exists says so and keeps it when it was trained from the same sample and
settings, and refuses when it was not (unless --overwrite). Example:

    python data_tools/train_tokenizer.py --corpus demo_out/corpus --out demo_out/tokenizer/spm \\
        --vocab-size 8000
"""

import argparse
import os
import sys

import _path  # noqa: F401

from megatron_rembert.cli import run_cli
from megatron_rembert.fs import unwritable_reason
from megatron_rembert.prep.corpus import DEFAULT_MAX_LINE_BYTES, SKIPPED_VS_ERRORS
from megatron_rembert.prep.tokenizer import train_tokenizer


def main(argv: list[str] | None = None) -> int:
    # Bad input exits 2 (docs/data.md); a file system failing while writing exits 1: nothing
    # committed is damaged.
    return run_cli(_main, argv, on_os_error="free space and rerun the same command")


def _main(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__, epilog="Bad input:\n" + SKIPPED_VS_ERRORS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help="corpus folder: DIR/<lang>/*.txt|jsonl[.gz]")
    p.add_argument("--out", required=True, help="output prefix, e.g. tokenizers/spm250k")
    p.add_argument("--vocab-size", type=int, default=250_000)
    p.add_argument("--alpha", type=float, default=0.5, help="language sampling exponent")
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--max-sentences", type=int, default=10_000_000,
                   help="cap on the number of sampled text chunks fed to SentencePiece")
    p.add_argument("--languages", nargs="*", help="subset of language folders")
    p.add_argument("--max-line-bytes", type=int, default=DEFAULT_MAX_LINE_BYTES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-hard-vocab-limit", action="store_true",
                   help="allow a smaller vocabulary than --vocab-size on small corpora")
    p.add_argument("--verbose", action="store_true", help="show SentencePiece's log")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a tokenizer at --out trained from another corpus or settings")
    a = p.parse_args(argv)
    # Output checks first: a failure after hours of training would lose the tokenizer.
    if os.path.isdir(a.out):
        p.error(f"--out {a.out} is a folder; --out is a prefix, e.g. {a.out}/spm")
    if reason := unwritable_reason(os.path.dirname(a.out) or "."):
        p.error(f"--out {a.out}: {reason}")
    info = train_tokenizer(a.corpus, a.out, a.vocab_size, a.alpha, a.character_coverage,
                           a.threads, a.max_sentences, a.seed, a.languages, a.max_line_bytes,
                           not a.no_hard_vocab_limit, a.verbose,
                           existing="overwrite" if a.overwrite else "reuse",
                           progress=lambda line: print(line, flush=True))
    if info.get("reused"):
        print(f"already done: {a.out}.model was trained from the same sample and settings "
              f"(sha256 {info['sha256']})")
        return 0
    print(f"wrote {a.out}.model ({info['vocab_size']:,} pieces, sha256 {info['sha256']})")
    for lang, v in info["languages"].items():
        print(f"{lang:10s} chunks {v['chunks']:>10,}  sampled {v['sampled']:>10,}  "
              f"p {v['prob']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
