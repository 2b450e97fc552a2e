"""Corpus folder -> dataset folder of packed Arrow shards (see docs/data.md).

Tokenises in worker threads, packs each language into [CLS] ... [SEP] rows of
--seq-length tokens, writes train/ and valid/ shards and manifest.json. Restartable: rerun the
same command after a kill and it resumes; finished shards are not redone. Example:

    python data_tools/preprocess.py --corpus demo_out/corpus \\
        --tokenizer demo_out/tokenizer/spm.model --out demo_out/data --seq-length 128
"""

import argparse
import sys

import _path  # noqa: F401

from megatron_rembert.cli import run_cli
from megatron_rembert.fs import is_inside, unwritable_reason
from megatron_rembert.prep.corpus import DEFAULT_MAX_LINE_BYTES, SKIPPED_VS_ERRORS
from megatron_rembert.prep.inspection import config_sampling_table, summary_table
from megatron_rembert.prep.preprocess import PreprocessConfig, preprocess


def main(argv: list[str] | None = None) -> int:
    # Bad input exits 2 (docs/data.md); a file system failing while writing exits 1: nothing
    # committed is damaged, and the same command resumes.
    return run_cli(_main, argv, on_os_error="free space and rerun the same command: it resumes")


def _main(argv: list[str] | None) -> int:
    d = PreprocessConfig("", "", "")
    p = argparse.ArgumentParser(description=__doc__, epilog="Bad input:\n" + SKIPPED_VS_ERRORS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help="corpus folder: DIR/<lang>/*.txt|jsonl[.gz]")
    p.add_argument("--tokenizer", required=True, help="SentencePiece .model")
    p.add_argument("--out", required=True, help="dataset folder")
    p.add_argument("--seq-length", type=int, default=d.seq_length)
    p.add_argument("--workers", type=int, default=d.workers,
                   help="tokeniser threads (0: all in the main thread; default: the CPUs this "
                        "process may use, %(default)s here)")
    p.add_argument("--shard-size-mb", type=float, default=d.shard_size_mb,
                   help="upper bound on a shard's size")
    p.add_argument("--valid-fraction", type=float, default=d.valid_fraction,
                   help="fraction of documents held out for validation")
    p.add_argument("--languages", nargs="*", help="subset of language folders")
    p.add_argument("--max-line-bytes", type=int, default=DEFAULT_MAX_LINE_BYTES,
                   help="longer lines are skipped (counted)")
    p.add_argument("--alpha", type=float, default=0.5, help="only for the summary's p column")
    p.add_argument("--config", help="a training config: also print each language's sampling "
                   "probability in every phase of its schedule")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a dataset in --out made with other settings")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    # Output checks first: nothing is read or written before they pass.
    if is_inside(a.out, a.corpus):
        p.error(f"--out {a.out} is inside --corpus {a.corpus}: the shards would become part "
                "of the corpus; choose a folder outside it")
    if reason := unwritable_reason(a.out):
        p.error(f"--out {a.out}: {reason}")
    cfg = PreprocessConfig(a.corpus, a.out, a.tokenizer, a.seq_length, a.workers,
                           a.shard_size_mb, a.valid_fraction, a.languages, a.max_line_bytes,
                           overwrite=a.overwrite, progress=not a.no_progress)
    manifest = preprocess(cfg)
    print(summary_table(manifest, a.alpha))
    if a.config:
        print(config_sampling_table(a.out, a.config))
    skipped = {k: v for k, v in manifest["skipped"].items() if v}
    print(f"skipped input: {skipped or 'nothing'}")
    print(f"wrote {len(manifest['shards'])} shards and {a.out}/manifest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
