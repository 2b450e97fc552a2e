"""Corpus folder -> dataset folder of packed, fixed-length token sequences.

Languages are processed one after the other. The main process reads each file as blocks of
whole lines (bytes, `corpus.iter_line_blocks`); worker processes, forked from a fork server,
turn a block into documents (decoding, the skip rules, JSON), tokenise them and sort them into
the train and validation splits, returning one flat int32 array per split; the main process
packs (one call per block and split) and writes, so the output is identical whatever the
number of workers. The main process's share is kept small: on 2 cores it shares one with a
worker.

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
import threading
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
    block_bytes: int = corpus_mod.DEFAULT_BLOCK_BYTES  # text per worker task
    overwrite: bool = False
    progress: bool = True

    @property
    def rows_per_shard(self) -> int:
        return max(1, int(self.shard_size_mb * 2**20) // (4 * self.seq_length))


_SP = None
_ENCODE = None  # texts -> (flat int32 ids, [len(texts) + 1] offsets), set in the worker


def _init_worker(model_path: str) -> None:
    # Not raising here: a failing Pool initializer respawns workers forever.
    global _SP, _ENCODE
    try:
        _SP = load_sentencepiece(model_path)
        _ENCODE = _buffer_encoder(_SP) or _list_encoder(_SP)
    except BaseException as e:  # noqa: BLE001 - re-raised by _tokenize
        _SP = e


def _offsets(lengths) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(lengths, dtype=np.int64, count=len(lengths)), out=out[1:])
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
            offsets = _offsets([memoryview(b).nbytes // 4 for b in bufs])
            return np.frombuffer(b"".join(bufs), dtype=np.int32), offsets

        probe = ["A probe, één 二 текст.", "", "and another line"]
        flat, offsets = encode(probe)
        got = [flat[offsets[i]:offsets[i + 1]].tolist() for i in range(len(probe))]
        return encode if got == sp.encode(probe) else None
    except Exception:  # noqa: BLE001 - any change inside SentencePiece: the public path
        return None


def _tokenize(block: corpus_mod.LineBlock, rel: str, kind: str, max_line_bytes: int,
              valid_fraction: float) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], int, dict]:
    """One block of lines of file `rel` -> ({split: (flat token ids, offsets)}, documents,
    skip counts). The worker does all the per-line work (decoding, the skip rules, JSON) and
    returns one flat array per split: the main process only reads bytes and packs, so on 2
    cores it leaves the workers nearly all the CPU."""
    if isinstance(_SP, BaseException):
        raise _SP
    stats = corpus_mod.SkipStats()
    lines, texts = corpus_mod.documents_in_block(block, kind, max_line_bytes, stats)
    valid = valid_docs(rel, lines, valid_fraction)
    out = {}
    for split in ("train", "valid"):
        mine = [t for t, v in zip(texts, valid, strict=True) if v == (split == "valid")]
        out[split] = _ENCODE(mine) if mine else (np.zeros(0, np.int32), _offsets([]))
    return out, len(texts), {k: getattr(stats, k) for k in _COUNTED}


def _worker_context():
    """Workers fork from a server process that imported this module once (so they start in
    milliseconds, without the main script's imports or its threads); spawn where there is
    no fork server (Windows)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


class _Done:
    """A result computed in this process, with the AsyncResult method ordered_map uses."""

    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class _PoolStarter:
    """Starts the worker pool in a thread: the fork server's start (importing this module,
    ~0.3 s) is not waited for; blocks submitted before the pool is up are tokenized in this
    process. Who tokenizes a block does not change its tokens."""

    def __init__(self, cfg: PreprocessConfig):
        self._pool = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._start, args=(cfg,), daemon=True)
        self._thread.start()

    def _start(self, cfg: PreprocessConfig) -> None:
        try:
            self._pool = _worker_context().Pool(cfg.workers, _init_worker, (cfg.tokenizer,))
        except BaseException as e:  # noqa: BLE001 - raised in the main thread by ready()
            self._error = e

    def ready(self):
        """The pool once started, else None; a failed start raises here, as it did when the
        pool was made in the main thread."""
        if self._error is not None:
            raise self._error
        return self._pool

    def close(self) -> None:
        self._thread.join()
        if self._pool is not None:
            self._pool.terminate()


def valid_docs(rel: str, lines: list[int], fraction: float) -> list[bool]:
    """Whether each document at `lines` of file `rel` goes to the validation split:
    crc32(f"{rel}\n{line}") < fraction * 2^32, with the file's part of the CRC computed once
    (CRC-32 runs on from a prefix's value)."""
    head, bound = zlib.crc32(f"{rel}\n".encode()), fraction * 2**32
    return [zlib.crc32(b"%d" % line, head) < bound for line in lines]


def is_valid_doc(rel: str, line: int, fraction: float) -> bool:
    return valid_docs(rel, [line], fraction)[0]


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
        # looked up once, not per block
        train, valid, cap = self.packers["train"], self.packers["valid"], cfg.rows_per_shard
        for fi in range(st["file_idx"], len(self.files)):
            cf = self.files[fi]
            start = st["line"] if fi == st["file_idx"] else 0

            def on_progress(pos, base=done_bytes):
                bar.update(base + pos, f"{self.lang} {st['documents']:,} docs")

            blocks = corpus_mod.iter_line_blocks(cf, start, cfg.max_line_bytes, cfg.block_bytes,
                                                 on_progress)
            for block, (tokens, n_docs, skipped) in ordered_map(
                lambda b, cf=cf: submit(b, cf.rel, cf.kind, cfg.max_line_bytes,
                                        cfg.valid_fraction),
                blocks, max_in_flight=8 * cfg.workers + 8,
            ):
                for split, (flat, offsets) in tokens.items():
                    self.packers[split].add_many(flat, offsets)
                st["documents"] += n_docs
                for k, v in skipped.items():
                    setattr(stats, k, getattr(stats, k) + v)
                # Checkpoints fall at block ends (blocks depend only on the file's bytes, so a
                # resumed run makes the same blocks).
                if max(train.n_rows, valid.n_rows) >= cap:
                    self.checkpoint(fi, block.first_line + block.n_lines,
                                    {k: getattr(stats, k) for k in _COUNTED})
            done_bytes += cf.size
            st["file_idx"], st["line"] = fi + 1, 0
        for p in self.packers.values():
            p.flush_partial()
        self.checkpoint(len(self.files), 0, {k: getattr(stats, k) for k in _COUNTED}, final=True)


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
    pool = _PoolStarter(cfg) if cfg.workers > 0 else None
    _init_worker(cfg.tokenizer)  # this process tokenizes until the pool is up (or, at 0, always)

    def submit(*args):
        ready = pool.ready() if pool is not None else None
        return ready.apply_async(_tokenize, args) if ready else _Done(_tokenize(*args))

    try:
        langs, before = {}, 0
        for lang, files in files_by_lang.items():
            langs[lang] = _Language(cfg, lang, files, ids, progress_dir)
            langs[lang].run(submit, bar, before)
            before += sum(f.size for f in files)
    finally:
        if pool is not None:
            pool.close()
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
