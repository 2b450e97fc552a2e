"""Throughput of the data pipeline, ours and its baseline side by side, on CPU.

    python -m bench.data_throughput            # ~30 MB demo corpus, 8000-piece tokenizer
    python -m bench.data_throughput --quick    # small smoke run (well under 30 s)
    python -m bench.data_throughput --data DIR # build into / reuse DIR instead of a temp folder

What is measured (each figure is the median of --repeats runs; min and max are printed too,
because on a shared machine single runs are noisy):
  loader      `build_pretraining_loader(..., num_workers=0)`: sampling, shard reads, masking
              and the numpy -> torch hand-off, all in this one process, so tokens/s is per
              core. tokens = micro-batches x micro-batch size x sequence length. The first
              micro-batch of each run is taken before the clock starts (opening the manifest
              and memory maps is a one-off cost, not throughput). Goal: --loader-goal (2M/s).
  loader+wwm  the same with whole-word masking.
  sp.encode   the baseline of preprocessing: `sp.encode(list_of_documents)` on the same
              documents with the same tokenizer, in this process, text already in memory,
              one thread (one core: what one preprocessing worker has). Two forms:
              "one call" encodes all documents at once and holds every id as a Python int
              (103k lists for 30 MB, which the garbage collector keeps walking: 10-20%
              slower); "in blocks" encodes them in batches of about preprocess's block size
              and drops each batch's ids, the faster and stricter baseline. The goal is
              judged against both.
  preprocess  `preprocess()` end to end (read, tokenise in --workers threads, pack, write
              shards, manifest) with 1 and with 2 workers, into a fresh folder each run. Its
              start-up (loading the tokenizer, the word-start table) is inside the clock.
              tokens = the same text tokens as the baseline, so the two rates compare.
Ratios printed last: loader / goal, preprocess per worker / sp.encode (goal >= 0.8), and
preprocess 2 workers / 1 worker (scaling). On a shared machine these wall-clock ratios move with
the load (another process holding a core slows one figure and not the other), so the same
ratios are also printed in CPU time, which the load does not change: tokens per CPU-second of
sp.encode against tokens per CPU-second of preprocess (all its threads, from getrusage).
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from megatron_rembert.cli import format_table
from megatron_rembert.data.config import DataConfig
from megatron_rembert.data.loader import build_pretraining_loader
from megatron_rembert.data.schedule import DataPlan
from megatron_rembert.parallel.layout import Layout
from megatron_rembert.prep.corpus import (
    DEFAULT_BLOCK_BYTES,
    SkipStats,
    discover_corpus,
    iter_documents,
)
from megatron_rembert.prep.demo_corpus import make_demo_corpus
from megatron_rembert.prep.preprocess import PreprocessConfig, preprocess
from megatron_rembert.prep.tokenizer import load_sentencepiece, train_tokenizer

# The smallest run (seconds): tests/bench/test_every_bench.py.
TINY_ARGS = ["--corpus-mb", "0.1", "--vocab-size", "1000", "--seq-length", "64",
             "--micro-batch", "2", "--batches", "2", "--repeats", "1"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small smoke run: 1.5 MB corpus, 1000 pieces, fewer batches and repeats")
    p.add_argument("--data", default=None,
                   help="work folder: reused if it holds corpus/, spm.model and dataset/, "
                        "else built there and kept (default: a temp folder, removed at the end)")
    p.add_argument("--corpus-mb", type=float, default=None, help="demo corpus size (default 30)")
    p.add_argument("--vocab-size", type=int, default=None, help="tokenizer pieces (default 8000)")
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--batches", type=int, default=None,
                   help="micro-batches per loader run (default 200, quick 20)")
    p.add_argument("--repeats", type=int, default=None, help="runs per figure (default 5, quick 2)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--loader-goal", type=float, default=2e6, help="loader tokens/s goal per core")
    p.add_argument("--preprocess-goal", type=float, default=0.8,
                   help="goal for preprocess tokens/s per worker / sp.encode tokens/s")
    p.add_argument("--skip-preprocess", action="store_true", help="loader figures only")
    args = p.parse_args(argv)
    quick = args.quick
    args.corpus_mb = args.corpus_mb or (1.5 if quick else 30.0)
    # 1000 pieces is the smallest that covers the demo corpus's 8 alphabets comfortably
    args.vocab_size = args.vocab_size or (1000 if quick else 8000)
    args.batches = args.batches or (20 if quick else 200)
    args.repeats = args.repeats or (2 if quick else 5)
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prepare(work: Path, args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """corpus/, spm.model and dataset/ under `work`, each built only if missing."""
    corpus, prefix, data = work / "corpus", work / "spm", work / "dataset"
    if not corpus.is_dir():
        log(f"making a {args.corpus_mb} MB demo corpus ...")
        make_demo_corpus(corpus, size_mb=args.corpus_mb, seed=args.seed)
    model = prefix.with_suffix(".model")
    if not model.is_file():
        log(f"training a {args.vocab_size}-piece tokenizer ...")
        train_tokenizer(corpus, prefix, vocab_size=args.vocab_size, num_threads=2,
                        max_sentences=200_000)
    if not (data / "manifest.json").is_file():
        log(f"preprocessing at sequence length {args.seq_length} ...")
        preprocess(PreprocessConfig(str(corpus), str(data), str(model),
                                    seq_length=args.seq_length, workers=1, progress=False))
    return corpus, model, data


# Tokens per CPU-second of this process, next to the wall-clock figures: on a shared machine
# the wall clock also counts the time other processes held the core, the CPU clock does not.
CPU_RATES: dict[tuple, list[float]] = {}


def repeat(fn: Callable[[], float], n: int) -> list[float]:
    return [fn() for _ in range(n)]


def loader_run(data: Path, args: argparse.Namespace, whole_word: bool) -> float:
    """Tokens/s of one fresh in-process loader over `args.batches` micro-batches."""
    config = DataConfig(path=str(data), seq_length=args.seq_length, whole_word_mask=whole_word)
    plan = DataPlan.resolve(config, 1, config.mask_prob)  # no schedule: one rate throughout
    it = build_pretraining_loader(config, Layout(micro_batch_size=args.micro_batch, gas=8), plan,
                                  seed=args.seed, num_workers=0,
                                  num_micro_batches=args.batches + 1)
    next(it)  # opens the manifest and the maps: a one-off, kept off the clock
    t, c = time.perf_counter(), time.process_time()
    n = sum(1 for _ in it)
    dt, dc = time.perf_counter() - t, time.process_time() - c
    CPU_RATES.setdefault(("loader", whole_word), []).append(
        n * args.micro_batch * args.seq_length / dc)
    return n * args.micro_batch * args.seq_length / dt


def load_documents(corpus: Path) -> list[str]:
    """The documents preprocess() sees, in its order (skips applied the same way)."""
    files, _ = discover_corpus(corpus)
    stats = SkipStats()
    return [t for fs in files.values() for cf in fs for _, t in iter_documents(cf, stats)]


def cpu_seconds() -> float:
    """CPU time of this process, all its threads."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


# (label, threads, in blocks?)
BASELINES = (("sp.encode, 1 thread, one call", 1, False),
             ("sp.encode, 1 thread, in blocks", 1, True),
             ("sp.encode, all threads, one call", -1, False))


def baseline_run(sp, docs: list[str], threads: int, batch: int | None = None
                 ) -> tuple[float, int]:
    """tokens/s of `sp.encode` over `docs`: in one call, or in calls of `batch` documents
    whose ids are dropped as they come."""
    t, c = time.perf_counter(), cpu_seconds()
    if batch is None:
        n = sum(map(len, sp.encode(docs, num_threads=threads)))
    else:
        n = sum(sum(map(len, sp.encode(docs[i:i + batch], num_threads=threads)))
                for i in range(0, len(docs), batch))
    dt, dc = time.perf_counter() - t, cpu_seconds() - c
    CPU_RATES.setdefault(("sp.encode", threads, batch), []).append(n / dc)
    return n / dt, n


def preprocess_run(corpus: Path, model: Path, work: Path, args: argparse.Namespace,
                   workers: int, text_tokens: int) -> float:
    out = Path(tempfile.mkdtemp(prefix="pre-", dir=work))
    try:
        cfg = PreprocessConfig(str(corpus), str(out), str(model), seq_length=args.seq_length,
                               workers=workers, progress=False)
        t, c = time.perf_counter(), cpu_seconds()
        preprocess(cfg)
        wall = time.perf_counter() - t
        CPU_RATES.setdefault(("preprocess", workers), []).append(
            text_tokens / (cpu_seconds() - c))
        return text_tokens / wall
    finally:
        shutil.rmtree(out, ignore_errors=True)


def summary(name: str, rates: list[float], unit_note: str = "") -> list:
    med = statistics.median(rates)
    spread = (max(rates) - min(rates)) / med if med else 0.0
    return [name, f"{med / 1e6:.3f}", f"{min(rates) / 1e6:.3f}", f"{max(rates) / 1e6:.3f}",
            f"{100 * spread:.0f}%", len(rates), unit_note]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.data:
        work = Path(args.data)
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="data-throughput-"))
    try:
        t0 = time.perf_counter()
        corpus, model, data = prepare(work, args)
        log(f"data ready in {time.perf_counter() - t0:.1f} s; measuring ...")
        rows, med = [], {}

        for label, wwm in (("loader (num_workers=0)", False), ("loader + whole-word mask", True)):
            loader_run(data, args, wwm)  # warm-up: imports, page cache, first-use allocations
            r = repeat(lambda w=wwm: loader_run(data, args, w), args.repeats)
            med[label] = statistics.median(r)
            cpu = statistics.median(CPU_RATES[("loader", wwm)][-args.repeats:])
            rows.append(summary(label, r, f"{args.batches} x {args.micro_batch} x "
                                          f"{args.seq_length} tokens, 1 process; "
                                          f"{cpu / 1e6:.3f} M per CPU-s"))

        if not args.skip_preprocess:
            sp = load_sentencepiece(model)
            docs = load_documents(corpus)
            _, text_tokens = baseline_run(sp, docs, 1)  # warm-up, and the token count
            text_bytes = sum(len(d.encode()) for d in docs)
            batch = max(1, round(len(docs) * DEFAULT_BLOCK_BYTES / text_bytes))
            for label, threads, b in BASELINES:
                b = batch if b else None
                r = [baseline_run(sp, docs, threads, b)[0] for _ in range(args.repeats)]
                med[label] = statistics.median(r)
                rows.append(summary(label, r, f"{text_tokens:,} text tokens, {len(docs):,} "
                                              "documents in memory"
                                              + (f", {b} a call" if b else "")))
            for w in (1, 2):
                label = f"preprocess, workers={w}"
                r = repeat(lambda w=w: preprocess_run(corpus, model, work, args, w, text_tokens),
                           args.repeats)
                med[label] = statistics.median(r)
                rows.append(summary(label, r, "end to end, same text tokens"))

        print(format_table(["what", "Mtok/s median", "min", "max", "spread", "runs", "note"],
                           rows))
        print()
        ratios = []
        for label in ("loader (num_workers=0)", "loader + whole-word mask"):
            x = med[label] / args.loader_goal
            ratios.append([f"{label} / goal {args.loader_goal / 1e6:g}M tok/s per core",
                           f"{x:.2f}", "met" if x >= 1 else "NOT met"])
        if not args.skip_preprocess:
            for label, _, _ in BASELINES[:2]:
                for w in (1, 2):
                    x = med[f"preprocess, workers={w}"] / w / med[label]
                    ratios.append([f"preprocess per worker (workers={w}) / {label}", f"{x:.2f}",
                                   "met" if x >= args.preprocess_goal else "NOT met"
                                   f" (goal {args.preprocess_goal:g})"])
            ratios.append(["scaling: preprocess workers=2 / workers=1",
                           f"{med['preprocess, workers=2'] / med['preprocess, workers=1']:.2f}",
                           "ideal 2.00"])
            for label, _, in_blocks in BASELINES[:2]:
                key = ("sp.encode", 1, batch if in_blocks else None)
                base_cpu = statistics.median(CPU_RATES[key][-args.repeats:])  # not the warm-up
                for w in (1, 2):
                    x = statistics.median(CPU_RATES[("preprocess", w)]) / base_cpu
                    ratios.append([f"CPU time: preprocess (workers={w}) / {label}",
                                   f"{x:.2f}", "tokens per CPU-second, load-independent"])
        print(format_table(["ratio", "value", "goal"], ratios))
    finally:
        if not args.data:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
