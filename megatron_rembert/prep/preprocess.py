"""Corpus folder -> dataset folder of packed, fixed-length token sequences.

The work runs as one stream over all languages (the next language's blocks are tokenized
while one's last rows are packed and written). The main thread reads each file as blocks of
whole lines (bytes, `corpus.iter_line_blocks`), turns a block into documents (decoding, the
skip rules, JSON), orders them train split first, then validation, and hands them to one of
`workers` threads, which only run SentencePiece's batch encoder (one call and one flat int32
array per block); the main thread packs the results (one call per block and split) and
writes, in input order, so the output is identical whatever the number of workers.

Threads, not processes: SentencePiece encodes without the GIL (2 threads run 1.8x one on 2
cores), and threads share the tokenizer and pay no start-up, pickling or pipe. Everything
else runs in the main thread (decoding, packing, writing: about 30% of the CPU time); with
the encoder's own Python side, about 40% holds the GIL, which caps the speed-up at about
2.5x one thread. On a large machine split the corpus by language (`--languages`) over
several runs and join them with `data_tools/merge_datasets.py`.

Packing: a language's documents form one stream `d1 [SEP] d2 [SEP] ...`, cut into pieces
of S-2 tokens, each stored as `[CLS] piece [SEP]`; a language's last sequence is padded. A
document goes to the validation split when a hash of (file, line) falls under
`valid_fraction`: stable across reruns and independent of the worker count.

Restart: after each batch of shards, `.progress/<lang>.json` records the input position and
names a new `.progress/<lang>.<n>.npz` with the carried-over tokens (written first, under a
name no committed json uses), so a rerun resumes there and rewrites byte-identical shards;
`manifest.json` is written last. A kill at any moment leaves at most a `.tmp-*` file (removed on
the next run), an uncommitted `.npz` (removed on resume) and never a half-written shard under a
final name.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_rembert.data.common import DataError, Ready, SpecialIds, ordered_map
from megatron_rembert.data.shards import MANIFEST, SCHEMA_VERSION, WORD_STARTS, write_shard
from megatron_rembert.fs import atomic_write, atomic_write_json, inside, sha256_file
from megatron_rembert.prep import corpus as corpus_mod
from megatron_rembert.prep.packing import Packer
from megatron_rembert.prep.progress import ProgressBar
from megatron_rembert.prep.tokenizer import check_special_ids, load_sentencepiece, word_start_table

_COUNTED = ("blank_lines", "bad_utf8_lines", "long_lines", "bad_json_lines")


def usable_cpus() -> int:
    """The CPUs this process may run on (a SLURM job's share, not the whole node)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass
class PreprocessConfig:
    corpus_dir: str
    output_dir: str
    tokenizer: str  # path to the SentencePiece .model
    seq_length: int = 512
    workers: int = field(default_factory=usable_cpus)  # tokenizer threads
    shard_size_mb: float = 256.0  # upper bound on a shard's size
    valid_fraction: float = 0.005
    languages: list[str] | None = None
    max_line_bytes: int = corpus_mod.DEFAULT_MAX_LINE_BYTES
    block_bytes: int = corpus_mod.DEFAULT_BLOCK_BYTES  # text per worker task
    overwrite: bool = False
    progress: bool = True

    @property
    def rows_per_shard(self) -> int:
        return max(1, int(self.shard_size_mb * 2**20) // (4 * self.seq_length))


def _offsets(lengths) -> np.ndarray:
    lengths = np.fromiter(lengths, dtype=np.int64)
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _list_encoder(sp):
    """`sp.encode` as lists of Python ints, flattened: converting the ints costs about a third
    of the encoding (40 ns a token against 110-160)."""
    def encode(texts):
        pieces = sp.encode(texts, num_threads=1)
        offsets = _offsets([len(p) for p in pieces])
        flat = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int32,
                           count=int(offsets[-1]))
        return flat, offsets
    return encode


def _buffer_encoder(sp):
    """SentencePiece's batch encoder that returns each document as a raw int32 buffer (what
    `encode(..., return_type="numpy")` wraps one array at a time, since version 0.2.1), joined
    with one copy: 4% over the bare encoding, against 14% through the public call and 35% for
    Python ints. It is not public API, so it is used only if it gives the public call's ids
    on a probe text; otherwise (or on other versions) None."""
    try:
        import sentencepiece

        method = getattr(sp._processor, sentencepiece._ENCODE_DISPATCH[True]["numpy"])

        def encode(texts):
            # args: inputs, threads, pool, sampling, nbest, alpha, add_bos, add_eos, reverse
            bufs = method(texts, 1, None, False, -1, 0.1, False, False, False)
            offsets = _offsets(map(len, map(memoryview, bufs)))  # int32 items
            return np.frombuffer(b"".join(bufs), dtype=np.int32), offsets

        probe = ["A probe, één 二 текст.", "", "and another line"]
        flat, offsets = encode(probe)
        got = [flat[offsets[i]:offsets[i + 1]].tolist() for i in range(len(probe))]
        return encode if got == sp.encode(probe) else None
    except Exception:  # noqa: BLE001 - any change inside SentencePiece: the public path
        return None


def _documents(block: corpus_mod.LineBlock, rel: str, kind: str, max_line_bytes: int,
               valid_fraction: float) -> tuple[list[str], int, dict]:
    """One block of lines of file `rel` -> (its documents' texts, the train split's first, then
    the validation split's; how many go to train; skip counts): the per-line work (decoding,
    the skip rules, JSON), run by the main thread."""
    stats = corpus_mod.SkipStats()
    lines, texts = corpus_mod.documents_in_block(block, kind, max_line_bytes, stats)
    valid = valid_docs(rel, lines, valid_fraction)
    n_train = len(texts) - int(np.count_nonzero(valid))
    if n_train < len(texts):  # most blocks of 1 MiB hold a few validation documents
        texts = list(itertools.compress(texts, ~valid)) + list(itertools.compress(texts, valid))
    return texts, n_train, {k: getattr(stats, k) for k in _COUNTED}


class _Tokenized:
    """A block's documents, their encoding submitted to `pool` (None: encoded here) as one
    call. `get`, what ordered_map waits on, returns ({split: (flat ids, offsets)}, documents,
    skips)."""

    def __init__(self, pool, encode, texts: list[str], n_train: int, skipped: dict):
        if not texts:
            self.tokens = Ready(None)
        elif pool is None:
            self.tokens = Ready(encode(texts))
        else:
            self.tokens = pool.submit(encode, texts)
        self.n_docs, self.n_train, self.skipped = len(texts), n_train, skipped

    def get(self):
        tokens, ready = {}, self.tokens
        result = ready.result() if isinstance(ready, Future) else ready.get()
        if result is not None:
            flat, offsets = result
            cut = offsets[self.n_train]  # views of the train and validation documents' ids
            if self.n_train:
                tokens["train"] = (flat[:cut], offsets[:self.n_train + 1])
            if self.n_train < self.n_docs:
                tokens["valid"] = (flat[cut:], offsets[self.n_train:] - cut)
        return tokens, self.n_docs, self.skipped


def valid_docs(rel: str, lines: list[int], fraction: float) -> np.ndarray:
    """Whether each document at `lines` of file `rel` goes to the validation split, as a bool
    array: crc32(f"{rel}\n{line}") < fraction * 2^32, with the file's part of the CRC computed
    once (CRC-32 runs on from a prefix's value), in C loops (map) rather than Python."""
    head, bound = zlib.crc32(f"{rel}\n".encode()), fraction * 2**32
    numbers = "\n".join(map(str, lines)).encode().split(b"\n") if lines else []
    crcs = np.fromiter(map(zlib.crc32, numbers, itertools.repeat(head)), np.uint32,
                       count=len(numbers))
    return crcs < bound


def is_valid_doc(rel: str, line: int, fraction: float) -> bool:
    return bool(valid_docs(rel, [line], fraction)[0])


class _Language:
    """Resumable processing of one language; state lives in `.progress/<lang>.json`, which
    names the `.progress/<lang>.<n>.npz` holding the tokens carried over at checkpoint n."""

    def __init__(self, cfg: PreprocessConfig, lang: str, files, ids: SpecialIds, progress_dir):
        self.cfg, self.lang, self.files, self.ids = cfg, lang, files, ids
        self.progress_dir = progress_dir
        self.json_path = progress_dir / f"{lang}.json"
        self.out = Path(cfg.output_dir)
        self.state = {"file_idx": 0, "line": 0, "documents": 0, "shards": [], "done": False,
                      "next_shard": {"train": 0, "valid": 0}, "skipped": dict.fromkeys(_COUNTED, 0),
                      "checkpoints": 0, "arrays": None}
        arrays = {}
        if self.json_path.exists():
            self.state = json.loads(self.json_path.read_text())
            # `arrays` is absent from the records of older versions, which used `<lang>.npz`.
            name = self.state.setdefault("arrays", f"{lang}.npz")
            self.state.setdefault("checkpoints", 0)
            # A name read from the file: it is loaded now and deleted at the next checkpoint.
            inside(progress_dir, name, self.json_path, DataError)
            if (progress_dir / name).exists():
                with np.load(progress_dir / name) as z:
                    arrays = dict(z)
        self._remove_stale_arrays()
        empty_rows = np.zeros((0, cfg.seq_length), np.int32)
        self.packers = {split: Packer(cfg.seq_length, ids,
                                      arrays.get(f"{split}_buf", np.zeros(0, np.int32)),
                                      arrays.get(f"{split}_rows", empty_rows))
                        for split in ("train", "valid")}

    def _write_shards(self, split: str, final: bool) -> None:
        p, cap = self.packers[split], self.cfg.rows_per_shard
        while p.n_rows >= cap or (final and p.n_rows):
            rows = p.take(cap)
            k = self.state["next_shard"][split]
            rel = f"{split}/{self.lang}/{self.lang}-{split}-{k:05d}.arrow"
            entry = write_shard(self.out / rel, rows, self.lang, self.ids.pad)
            self.state["shards"].append({"file": rel, "split": split, **entry})
            self.state["next_shard"][split] = k + 1

    def _remove_stale_arrays(self) -> None:
        """Delete this language's `.npz` files other than the committed one: left by a kill
        between writing a checkpoint's arrays and its json, or before the old file's removal."""
        mine = re.compile(rf"{re.escape(self.lang)}(\.\d+)?\.npz")
        for p in self.progress_dir.glob("*.npz"):
            if p.name != self.state["arrays"] and mine.fullmatch(p.name):
                p.unlink()

    def checkpoint(self, file_idx: int, line: int, skipped: dict, final: bool = False) -> None:
        """Write the complete shards, then commit them with the input position and carried-over
        tokens. The json is the only commit point: the arrays go to a new file named in it
        (never over the committed one), so a kill between the two writes leaves the previous
        json with its own arrays, not the previous position with the new tokens (which a
        resume would pack twice)."""
        # Validation rows are flushed at every checkpoint so the saved state stays small.
        self._write_shards("train", final)
        self._write_shards("valid", final=True)
        arrays = {f"{s}_{k}": v for s, p in self.packers.items()
                  for k, v in (("buf", p.buf), ("rows", p.take(p.n_rows)))}
        for s, p in self.packers.items():
            p.rows = [arrays[f"{s}_rows"]] if len(arrays[f"{s}_rows"]) else []
        n = self.state["checkpoints"] + 1
        name = f"{self.lang}.{n:06d}.npz"
        atomic_write(self.progress_dir / name, lambda f: np.savez(f, **arrays))
        old = self.state["arrays"]
        self.state.update(file_idx=file_idx, line=line, skipped=skipped, done=final,
                          checkpoints=n, arrays=name)
        atomic_write_json(self.json_path, self.state)  # last: it commits the shards above
        if old is not None and old != name:
            (self.progress_dir / old).unlink(missing_ok=True)

    def tasks(self, bar: ProgressBar, bytes_before: int):
        """The work left in this language, in order: `(self, i, block)` for each block of
        file i from the resume point on, `(self, i, None)` at the end of file i."""
        st = self.state
        first_file, first_line = st["file_idx"], st["line"]  # the resume point
        done_bytes = bytes_before + sum(f.size for f in self.files[:first_file])
        for fi in range(first_file, len(self.files)):
            cf = self.files[fi]
            start = first_line if fi == first_file else 0

            def on_progress(pos, base=done_bytes):
                bar.update(base + pos, f"{self.lang} {st['documents']:,} docs")

            for block in corpus_mod.iter_line_blocks(cf, start, self.cfg.max_line_bytes,
                                                     self.cfg.block_bytes, on_progress):
                yield self, fi, block
            done_bytes += cf.size
            yield self, fi, None

    def take(self, fi: int, block, result) -> None:
        """Pack the tokens of one block of file `fi` (`block` None: the file's end, after its
        last block), in input order."""
        st, files = self.state, self.files
        if block is None:
            st["file_idx"], st["line"] = fi + 1, 0
            if fi + 1 == len(files):  # the language's end
                for p in self.packers.values():
                    p.flush_partial()
                self.checkpoint(len(files), 0, st["skipped"], final=True)
            return
        tokens, n_docs, skipped = result
        for split, (flat, offsets) in tokens.items():
            self.packers[split].add_many(flat, offsets)
        st["documents"] += n_docs
        st["skipped"] = {k: st["skipped"][k] + skipped[k] for k in _COUNTED}
        # Checkpoints fall at block ends (blocks depend only on the file's bytes, so a
        # resumed run makes the same blocks).
        if max(p.n_rows for p in self.packers.values()) >= self.cfg.rows_per_shard:
            self.checkpoint(fi, block.first_line + block.n_lines, st["skipped"])


def _settings(cfg: PreprocessConfig, tok_sha: str, files_by_lang) -> dict:
    return {"tokenizer_sha256": tok_sha, "seq_length": cfg.seq_length,
            "rows_per_shard": cfg.rows_per_shard, "valid_fraction": cfg.valid_fraction,
            "max_line_bytes": cfg.max_line_bytes,
            "files": {lang: [[f.rel, f.size] for f in fs] for lang, fs in files_by_lang.items()}}


def _prepare_output(cfg: PreprocessConfig, settings: dict) -> Path:
    out, progress_dir = Path(cfg.output_dir), Path(cfg.output_dir) / ".progress"
    settings_path = progress_dir / "settings.json"
    if settings_path.exists() and json.loads(settings_path.read_text()) != settings:
        if not cfg.overwrite:
            old = json.loads(settings_path.read_text())
            diff = sorted(k for k in settings if old.get(k) != settings[k])
            raise DataError(f"{out} holds a dataset made with other settings ({', '.join(diff)} "
                            "differ); pass a new --out folder, or --overwrite to replace it.")
        for name in ("train", "valid", ".progress", MANIFEST, WORD_STARTS):
            p = out / name
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    elif not settings_path.exists() and (out / MANIFEST).exists() and not cfg.overwrite:
        raise DataError(f"{out} holds a dataset without progress records; pass a new --output "
                        "folder or --overwrite.")
    for tmp in out.rglob(".tmp-*"):  # leftovers of a killed run, never referenced by anything
        tmp.unlink()
    atomic_write_json(settings_path, settings)
    return progress_dir


def preprocess(cfg: PreprocessConfig) -> dict:
    """Run (or resume) preprocessing; return the manifest it wrote."""
    if cfg.seq_length < 8:
        raise DataError(f"--seq-length {cfg.seq_length} is too small; use at least 8.")
    if cfg.workers < 0:
        raise DataError(f"--workers {cfg.workers} must be 0 or more.")
    if not 0.0 <= cfg.valid_fraction < 1.0:
        raise DataError(f"--valid-fraction {cfg.valid_fraction} must be in [0, 1).")
    sp = load_sentencepiece(cfg.tokenizer)
    ids = check_special_ids(sp, cfg.tokenizer)
    tok_sha = sha256_file(cfg.tokenizer)
    files_by_lang, stats = corpus_mod.discover_corpus(cfg.corpus_dir, cfg.languages)
    progress_dir = _prepare_output(cfg, _settings(cfg, tok_sha, files_by_lang))
    out = Path(cfg.output_dir)
    atomic_write(out / WORD_STARTS, lambda f: np.save(f, word_start_table(sp)))
    total = sum(f.size for fs in files_by_lang.values() for f in fs)
    bar = ProgressBar(total, "preprocess", enabled=cfg.progress)
    encode = _buffer_encoder(sp) or _list_encoder(sp)
    pool = ThreadPoolExecutor(cfg.workers, "tokenize") if cfg.workers > 0 else None
    langs, befores, before = {}, {}, 0
    for lang, files in files_by_lang.items():
        langs[lang] = _Language(cfg, lang, files, ids, progress_dir)
        befores[lang], before = before, before + sum(f.size for f in files)

    def tasks():
        # One stream over all languages: the next language's blocks are tokenized while
        # this one's last blocks are packed and its final shards written.
        for lang, job in langs.items():
            if not job.state["done"]:
                yield from job.tasks(bar, befores[lang])

    def submit(task):
        job, fi, block = task
        if block is None:
            return Ready()  # a file's end: nothing to wait for
        cf = job.files[fi]
        docs = _documents(block, cf.rel, cf.kind, cfg.max_line_bytes, cfg.valid_fraction)
        return _Tokenized(pool, encode, *docs)

    try:
        for (job, fi, block), result in ordered_map(submit, tasks(),
                                                    max_in_flight=4 * cfg.workers + 4):
            job.take(fi, block, result)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        bar.close()
    manifest = _build_manifest(cfg, sp, tok_sha, ids, langs, stats, out)
    atomic_write_json(out / MANIFEST, manifest)
    return manifest


def _build_manifest(cfg, sp, tok_sha, ids, langs, stats, out) -> dict:
    shards, per_lang = [], {}
    for lang, job in langs.items():
        st = job.state
        shards += st["shards"]
        for k in _COUNTED:
            setattr(stats, k, getattr(stats, k) + st["skipped"][k])
        row = {"documents": st["documents"]}
        for split in ("train", "valid"):
            mine = [s for s in st["shards"] if s["split"] == split]
            row[f"{split}_rows"] = sum(s["rows"] for s in mine)
            row[f"{split}_tokens"] = sum(s["tokens"] for s in mine)
        if st["documents"] == 0:
            stats.empty_languages.append(lang)
        per_lang[lang] = row
    if not shards:
        raise DataError(f"no documents found in {cfg.corpus_dir}; {stats.report()}")
    return {
        "schema_version": SCHEMA_VERSION,
        "tokenizer": {"sha256": tok_sha, "vocab_size": sp.get_piece_size(),
                      "model_file": Path(cfg.tokenizer).name},
        "seq_length": cfg.seq_length,
        "special_ids": ids.to_dict(),
        "word_starts": {"file": WORD_STARTS, "sha256": sha256_file(out / WORD_STARTS)},
        "valid_fraction": cfg.valid_fraction,
        "shards": shards,
        "languages": per_lang,
        "skipped": stats.to_dict(),
    }
