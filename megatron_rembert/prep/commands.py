"""The data tools' command lines: parse, check the output first, call `prep/`.

Console scripts (`pip install -e .`): rembert-make-demo-corpus, rembert-libreoffice-corpus,
rembert-train-tokenizer, rembert-preprocess, rembert-merge-datasets, rembert-inspect-shards;
`python data_tools/X.py` runs the same function. Bad input exits 2 with one `error:` line; a
file system failing while writing exits 1 with one line naming the file, nothing committed
damaged (`cli.run_cli`, docs/data.md). Each tool imports only what it needs, when it runs.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from megatron_rembert.cli import run_cli
from megatron_rembert.fs import is_inside, unwritable_reason

RERUN = "free space and rerun the same command"


def _parser(description: str, epilog: str | None = None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=description, epilog=epilog,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


# -- rembert-make-demo-corpus ------------------------------------------------------------------
DEMO_CORPUS = """\
Write the synthetic multilingual demo corpus (8 languages, 8 scripts, Zipfian vocabularies,
fixed word orders). Deterministic and offline. Example:

    rembert-make-demo-corpus --out demo_out/corpus --size-mb 4
"""


def make_demo_corpus(argv: list[str] | None = None) -> int:
    return run_cli(_make_demo_corpus, argv, on_os_error=RERUN)


def _make_demo_corpus(argv: list[str] | None) -> int:
    from megatron_rembert.prep.demo_corpus import LANGUAGES
    from megatron_rembert.prep.demo_corpus import make_demo_corpus as write_corpus

    p = _parser(DEMO_CORPUS)
    p.add_argument("--out", required=True, help="output corpus folder (DIR/<lang>/...)")
    p.add_argument("--size-mb", type=float, default=4.0, help="total size of the text (MB)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--languages", nargs="*", choices=[x.code for x in LANGUAGES],
                   help="subset of languages (default: all)")
    args = p.parse_args(argv)
    if reason := unwritable_reason(args.out):
        p.error(f"--out {args.out}: {reason}")
    docs = write_corpus(args.out, args.size_mb, args.seed, args.languages)
    for lang, n in docs.items():
        print(f"{lang:8s} {n:8,d} documents")
    return 0


# -- rembert-libreoffice-corpus ----------------------------------------------------------------
LIBREOFFICE = """\
Real multilingual text: LibreOffice's help pages from Debian's libreoffice-help-<lang>
packages -> a pre-training corpus (OUT/corpus/<lang>/help.txt) and evaluation sets aligned by
paragraph (OUT/eval/parallel/<lang>.jsonl, OUT/eval/topic/{train,test}.jsonl), with
OUT/summary.json. Nothing is downloaded; fetch the packages first (en-us is required):

    mkdir lo_debs && cd lo_debs
    apt-get download libreoffice-help-en-us libreoffice-help-de libreoffice-help-ja
    cd .. && rembert-libreoffice-corpus --debs lo_debs --out lo_out

Pages held out for evaluation (--eval-fraction, by a hash of the page's path and --seed) give
no text to the corpus in any language. --out must be new, empty or a previous output of this
command, which is then replaced (the files it no longer writes are removed). See docs/data.md.
"""


def make_libreoffice_corpus(argv: list[str] | None = None) -> int:
    return run_cli(_libreoffice_corpus, argv, on_os_error=RERUN)


def _libreoffice_corpus(argv: list[str] | None) -> int:
    from megatron_rembert.prep.libreoffice import (
        OWNED,
        LibreOfficeConfig,
        build_libreoffice_corpus,
        parse_languages,
        summary_table,
    )
    from megatron_rembert.prep.staged_output import foreign_entries

    d = LibreOfficeConfig("", "")
    p = _parser(LIBREOFFICE)
    p.add_argument("--debs", required=True, help="folder of libreoffice-help-<lang>_*.deb files")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--languages", type=parse_languages,
                   help="comma-separated package codes, e.g. de,fr,pt-br,zh-cn (default: every "
                        "package in --debs; en-us is always read)")
    p.add_argument("--eval-fraction", type=float, default=d.eval_fraction,
                   help="fraction of the pages held out for evaluation (default %(default)s)")
    p.add_argument("--min-chars", type=int, default=d.min_chars,
                   help="drop paragraphs whose English text is shorter (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the page split (default %(default)s)")
    a = p.parse_args(argv)
    # Output checks first: nothing is read or written before they pass.
    if is_inside(a.out, a.debs):
        p.error(f"--out {a.out} is inside --debs {a.debs}; choose a folder outside it")
    if reason := unwritable_reason(a.out):
        p.error(f"--out {a.out}: {reason}")
    if foreign := foreign_entries(Path(a.out), OWNED):  # StagedOutput checks it again
        p.error(f"--out {a.out} holds files this command did not write ({', '.join(foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}); choose a new or empty folder")
    start = time.perf_counter()
    summary = build_libreoffice_corpus(
        LibreOfficeConfig(a.debs, a.out, a.languages, a.eval_fraction, a.min_chars, a.seed),
        progress=lambda line: print(line, flush=True))
    print(summary_table(summary))
    for line in summary["packages_without_pages"].values():
        print(f"skipped (no help pages): {line}")
    topic = summary["topic"]
    print("topic labels (train/test): " + ", ".join(
        f"{k} {v['train']}/{v['test']}" for k, v in topic["labels"].items())
        + (f"; dropped (too few): {topic['dropped_labels']}" if topic["dropped_labels"] else ""))
    print(f"wrote {a.out}/summary.json in {time.perf_counter() - start:.1f} s")
    return 0


# -- rembert-train-tokenizer -------------------------------------------------------------------
TOKENIZER = """\
Train the SentencePiece unigram tokenizer (RemBERT's kind) on a corpus folder.

Text is sampled per language with probability proportional to n_l^alpha, so small languages
are covered. Writes PREFIX.model, PREFIX.vocab and PREFIX.json (special ids
[PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4, the model's sha256, per-language sampling).

The same corpus and settings (--threads included) give a byte-identical .model. A rerun whose
tokenizer already exists says so and keeps it when it was trained from the same sample and
settings, and refuses when it was not (unless --overwrite). Example:

    rembert-train-tokenizer --corpus demo_out/corpus --out demo_out/tokenizer/spm \\
        --vocab-size 8000
"""


def train_tokenizer(argv: list[str] | None = None) -> int:
    return run_cli(_train_tokenizer, argv, on_os_error=RERUN)


def _train_tokenizer(argv: list[str] | None) -> int:
    from megatron_rembert.prep.corpus import DEFAULT_MAX_LINE_BYTES, SKIPPED_VS_ERRORS
    from megatron_rembert.prep.tokenizer import train_tokenizer as train

    p = _parser(TOKENIZER, epilog="Bad input:\n" + SKIPPED_VS_ERRORS)
    p.add_argument("--corpus", required=True, help="corpus folder: DIR/<lang>/*.txt|jsonl[.gz]")
    p.add_argument("--out", required=True, help="output prefix, e.g. tokenizers/spm250k")
    p.add_argument("--vocab-size", type=int, default=250_000)
    p.add_argument("--alpha", type=float, default=0.5, help="language sampling exponent")
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--max-sentences", type=int, default=10_000_000,
                   help="cap on the text passages (paragraphs, cut at 1,000 characters) "
                   "sampled for SentencePiece")
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
    info = train(a.corpus, a.out, a.vocab_size, a.alpha, a.character_coverage, a.threads,
                 a.max_sentences, a.seed, a.languages, a.max_line_bytes,
                 not a.no_hard_vocab_limit, a.verbose,
                 existing="overwrite" if a.overwrite else "reuse",
                 progress=lambda line: print(line, flush=True))
    if info.get("reused"):
        print(f"already done: {a.out}.model was trained from the same sample and settings "
              f"(sha256 {info['sha256']})")
        return 0
    print(f"wrote {a.out}.model ({info['vocab_size']:,} pieces, sha256 {info['sha256']})")
    print(f"{'language':10s} {'passages':>10}  {'in sample':>10}  share")
    for lang, v in info["languages"].items():
        print(f"{lang:10s} {v['chunks']:>10,}  {v['sampled']:>10,}  {v['prob']:.3f}")
    return 0


# -- rembert-preprocess ------------------------------------------------------------------------
PREPROCESS = """\
Corpus folder -> dataset folder of packed Arrow shards (see docs/data.md).

Tokenises in worker threads, packs each language into [CLS] ... [SEP] rows of
--seq-length tokens, writes train/ and valid/ shards and manifest.json. Restartable: rerun the
same command after a kill and it resumes; finished shards are not redone. Example:

    rembert-preprocess --corpus demo_out/corpus --tokenizer demo_out/tokenizer/spm.model \\
        --out demo_out/data --seq-length 128
"""


def preprocess(argv: list[str] | None = None) -> int:
    return run_cli(_preprocess, argv, on_os_error=f"{RERUN}: it resumes")


def _preprocess(argv: list[str] | None) -> int:
    from megatron_rembert.prep.corpus import DEFAULT_MAX_LINE_BYTES, SKIPPED_VS_ERRORS
    from megatron_rembert.prep.inspection import config_sampling_table, summary_table
    from megatron_rembert.prep.preprocess import PreprocessConfig
    from megatron_rembert.prep.preprocess import preprocess as run

    d = PreprocessConfig("", "", "")
    p = _parser(PREPROCESS, epilog="Bad input:\n" + SKIPPED_VS_ERRORS)
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
    manifest = run(PreprocessConfig(a.corpus, a.out, a.tokenizer, a.seq_length, a.workers,
                                    a.shard_size_mb, a.valid_fraction, a.languages,
                                    a.max_line_bytes, overwrite=a.overwrite,
                                    progress=not a.no_progress))
    print(summary_table(manifest, a.alpha))
    if a.config:
        print(config_sampling_table(a.out, a.config))
    skipped = {k: v for k, v in manifest["skipped"].items() if v}
    print(f"skipped input: {skipped or 'nothing'}")
    print(f"wrote {len(manifest['shards'])} shards and {a.out}/manifest.json")
    return 0


# -- rembert-merge-datasets --------------------------------------------------------------------
MERGE = """\
Merge dataset folders made by preprocessing from disjoint sets of languages into one folder
with one manifest.json (slurm/preprocess.sbatch runs one part per array task). Example:

    rembert-merge-datasets --out demo_out/data demo_out/data.parts/*

Languages are packed independently, so the merged folder holds the same shards, in the same
order, as one preprocessing run over all the languages. Shards are hard-linked when the parts
are on the same file system (no extra space), copied otherwise; manifest.json is written last,
so a killed merge leaves no dataset behind and a rerun finishes it.
"""


def merge_datasets(argv: list[str] | None = None) -> int:
    return run_cli(_merge_datasets, argv, on_os_error=RERUN)


def _merge_datasets(argv: list[str] | None) -> int:
    from megatron_rembert.data.shards import MANIFEST
    from megatron_rembert.prep.merge import merge

    p = _parser(MERGE)
    p.add_argument("parts", nargs="+", type=Path, help="dataset folders made by preprocessing")
    p.add_argument("--out", required=True, type=Path, help="merged dataset folder")
    a = p.parse_args(argv)
    # Output checks first: nothing is linked or copied before they pass.
    for part in a.parts:
        if is_inside(a.out, part):
            p.error(f"--out {a.out} is inside the part {part}; merge into a new folder")
    if reason := unwritable_reason(a.out):
        p.error(f"--out {a.out}: {reason}")
    manifest = merge(a.parts, a.out)
    print(f"merged {len(a.parts)} part(s): {len(manifest['languages'])} languages, "
          f"{len(manifest['shards'])} shards -> {a.out}/{MANIFEST}")
    return 0


# -- rembert-inspect-shards --------------------------------------------------------------------
INSPECT = """\
Summarise, verify or decode a dataset folder made by preprocessing. Examples:

    rembert-inspect-shards demo_out/data
    rembert-inspect-shards demo_out/data --verify --tokenizer demo_out/tokenizer/spm.model
    rembert-inspect-shards demo_out/data --decode 3 --tokenizer demo_out/tokenizer/spm.model
    rembert-inspect-shards data/mmbert --config configs/mmbert.yaml

Exit code 1 when --verify finds problems, 2 on an unreadable dataset.
"""


def inspect_shards(argv: list[str] | None = None) -> int:
    return run_cli(_inspect_shards, argv)


def _inspect_shards(argv: list[str] | None) -> int:
    from megatron_rembert.prep.inspection import (
        config_sampling_table,
        decode_samples,
        summarize,
        verify,
    )

    p = _parser(INSPECT)
    p.add_argument("data_dir")
    p.add_argument("--verify", action="store_true",
                   help="check checksums, schema, counts and the token-id range of every shard")
    p.add_argument("--decode", type=int, metavar="N", default=0,
                   help="print N random rows as text (needs --tokenizer)")
    p.add_argument("--split", choices=["train", "valid"], default="train")
    p.add_argument("--tokenizer", help="SentencePiece .model the dataset was made with")
    p.add_argument("--config", help="a training config: also print each language's sampling "
                   "probability in every phase of its schedule")
    a = p.parse_args(argv)
    print(summarize(a.data_dir))
    if a.config:
        print(config_sampling_table(a.data_dir, a.config))
    if a.verify:
        problems = verify(a.data_dir, a.tokenizer)
        for msg in problems:
            print(f"PROBLEM: {msg}")
        print(f"verify: {len(problems)} problem(s)")
        if problems:
            return 1
    if a.decode:
        if not a.tokenizer:
            p.error("--decode needs --tokenizer PATH.model")
        for lang, text in decode_samples(a.data_dir, a.tokenizer, a.decode, a.split):
            print(f"--- [{lang}] {text}")
    return 0
