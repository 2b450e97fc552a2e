"""Corpus folder -> dataset folder of packed, fixed-length token sequences.

Languages are processed one after the other; worker processes tokenise batches of documents
and sort them into the train and validation splits, while the main process reads, packs (one
call per batch and split) and writes, so the output is identical whatever the number of
workers. The main process's share is kept small: on 2 cores it shares one with a worker.
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
import multiprocessing as mp
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_rembert.data import corpus as corpus_mod
from megatron_rembert.data.common import (
    DataError,
    ProgressBar,
    SpecialIds,
    atomic_write,
    atomic_write_json,
    ordered_map,
    sha256_file,
)
from megatron_rembert.data.packing import Packer
from megatron_rembert.data.shards import MANIFEST, SCHEMA_VERSION, WORD_STARTS, write_shard
from megatron_rembert.data.tokenizer import check_special_ids, load_sentencepiece, word_start_table

_COUNTED = ("blank_lines", "bad_utf8_lines", "long_lines", "bad_json_lines")


@dataclass
class PreprocessConfig:
    corpus_dir: str
    output_dir: str
    tokenizer: str  # path to the SentencePiece .model
    seq_length: int = 512
    workers: int = max(1, (os.cpu_count() or 2) - 1)
    shard_size_mb: float = 256.0  # upper bound on a shard's size
    valid_fraction: float = 0.005
    languages: list[str] | None = None
    max_line_bytes: int = corpus_mod.DEFAULT_MAX_LINE_BYTES
    docs_per_task: int = 256
    overwrite: bool = False
    progress: bool = True

    @property
    def rows_per_shard(self) -> int:
        return max(1, int(self.shard_size_mb * 2**20) // (4 * self.seq_length))


_SP = None


def _init_worker(model_path: str) -> None:
    # Not raising here: a failing Pool initializer respawns workers forever.
    global _SP
    try:
        _SP = load_sentencepiece(model_path)
    except BaseException as e:  # noqa: BLE001 - re-raised by _tokenize
        _SP = e


def _tokenize(texts: list[str], rel: str, lines: list[int], valid_fraction: float
              ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Split -> (token ids of its documents as one flat int32 array, [docs + 1] offsets), for
    the documents `texts` at `lines` of file `rel`.

    One thread: a worker is one core (`--workers` sets the parallelism; SentencePiece's own
    threads would only oversubscribe the cores). One flat array per split instead of one per
    document: pickling ~256 small arrays back to the main process cost more than the encoding,
    and the main process packs each split's batch in one call (Packer.add_many)."""
    if isinstance(_SP, BaseException):
        raise _SP
    pieces = _SP.encode(texts, num_threads=1)
    out = {}
    for split in ("train", "valid"):
        mine = [p for p, line in zip(pieces, lines, strict=True)
                if (split == "valid") == is_valid_doc(rel, line, valid_fraction)]
        offsets = np.zeros(len(mine) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, mine), dtype=np.int64, count=len(mine)),
                  out=offsets[1:])
        out[split] = (np.fromiter(itertools.chain.from_iterable(mine), dtype=np.int32,
                                  count=int(offsets[-1])), offsets)
    return out


def is_valid_doc(rel: str, line: int, fraction: float) -> bool:
    return zlib.crc32(f"{rel}\n{line}".encode()) < fraction * 2**32


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

    def run(self, submit, bar: ProgressBar, bytes_before: int) -> None:
        if self.state["done"]:
            return
        cfg, st = self.cfg, self.state
        stats = corpus_mod.SkipStats(**st["skipped"])
        done_bytes = bytes_before + sum(f.size for f in self.files[: st["file_idx"]])
        # looked up once, not per batch
        train, valid, cap = self.packers["train"], self.packers["valid"], cfg.rows_per_shard
        for fi in range(st["file_idx"], len(self.files)):
            cf = self.files[fi]
            start = st["line"] if fi == st["file_idx"] else 0

            def on_progress(pos, base=done_bytes):
                bar.update(base + pos, f"{self.lang} {st['documents']:,} docs")

            docs = corpus_mod.iter_documents(cf, stats, start, cfg.max_line_bytes, on_progress)
            for (lines, _, skipped), tokens in ordered_map(
                lambda b, rel=cf.rel: submit(b[1], rel, b[0], cfg.valid_fraction),
                _batched(docs, stats, cfg.docs_per_task), max_in_flight=2 * cfg.workers + 2,
            ):
                for split, (flat, offsets) in tokens.items():
                    self.packers[split].add_many(flat, offsets)
                st["documents"] += len(lines)
                # Checkpoints fall at batch ends (batches start at a file's first line or at
                # the previous checkpoint, so a resumed run makes the same batches).
                if max(train.n_rows, valid.n_rows) >= cap:
                    self.checkpoint(fi, lines[-1] + 1, skipped)
            done_bytes += cf.size
            st["file_idx"], st["line"] = fi + 1, 0
        for p in self.packers.values():
            p.flush_partial()
        self.checkpoint(len(self.files), 0, {k: getattr(stats, k) for k in _COUNTED}, final=True)


def _batched(docs, stats, n):
    """Group documents into batches of (lines, texts, skip counts after the last of them)."""
    lines, texts = [], []
    for line, text in docs:
        lines.append(line)
        texts.append(text)
        if len(lines) == n:
            yield lines, texts, {k: getattr(stats, k) for k in _COUNTED}
            lines, texts = [], []
    if lines:
        yield lines, texts, {k: getattr(stats, k) for k in _COUNTED}


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
    pool = None
    if cfg.workers > 0:
        pool = mp.get_context("spawn").Pool(cfg.workers, _init_worker, (cfg.tokenizer,))

        def submit(*args):
            return pool.apply_async(_tokenize, args)
    else:
        _init_worker(cfg.tokenizer)

        class _Done:
            def __init__(self, v):
                self.v = v

            def get(self):
                return self.v

        def submit(*args):
            return _Done(_tokenize(*args))
    try:
        langs, before = {}, 0
        for lang, files in files_by_lang.items():
            langs[lang] = _Language(cfg, lang, files, ids, progress_dir)
            langs[lang].run(submit, bar, before)
            before += sum(f.size for f in files)
    finally:
        if pool is not None:
            pool.terminate()
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
