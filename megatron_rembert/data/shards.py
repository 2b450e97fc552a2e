"""The shard format and its memory-mapped, zero-copy reader.

A dataset folder holds `manifest.json`, `word_starts.npy` and `<split>/<lang>/*.arrow`: Arrow
IPC files (uncompressed, one record batch each) with columns `input_ids` (fixed-size list of
int32, length = sequence length) and `lang` (string). The manifest is written last, atomically,
so a folder without one is unfinished; the reader opens only the shards the manifest lists and
checks each one's size, schema and row count against it.

What the reader checks when (docs/data.md, "What is checked when"):
- on construction: every shard the manifest lists, in both splits, exists with its recorded
  size; this split's shards open with the expected schema and row count;
- with `verify_in_background=True`: each shard's sha256, hashed once per process by a
  background thread, this split's shards first, then the other's (`wait_verified` holds the
  rows of a shard until its check has passed);
  `verify_checksums=True` hashes them all in the constructor instead;
- on every `get`: each token id is in [0, vocab_size).
"""

from __future__ import annotations

import json
import os
import queue
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pyarrow as pa

from megatron_rembert.data.common import DataError, SpecialIds
from megatron_rembert.fs import HashingFile, atomic_write, inside, sha256_file

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
WORD_STARTS = "word_starts.npy"
SPLITS = ("train", "valid")
ARROW_FILE_MAGIC = b"ARROW1"  # first bytes of the IPC file format (shards of older datasets)


def arrow_schema(seq_length: int) -> pa.Schema:
    return pa.schema([pa.field("input_ids", pa.list_(pa.int32(), seq_length), nullable=False),
                      pa.field("lang", pa.string(), nullable=False)])


def write_shard(path: str | os.PathLike, rows: np.ndarray, lang: str, pad_id: int) -> dict:
    """Atomically write `rows` ([n, S] int32) as one shard; return its manifest entry
    (without the `file` key): rows, tokens (non-pad), bytes, sha256."""
    n, seq_length = rows.shape
    # Arrays built from their buffers: `pa.array` of a numpy array or a list imports pandas
    # (0.4 s, a sixth of a 30 MB corpus's preprocessing) to check whether it was given one.
    flat = np.ascontiguousarray(rows, dtype=np.int32).reshape(-1)
    ids = pa.FixedSizeListArray.from_arrays(
        pa.Array.from_buffers(pa.int32(), len(flat), [None, pa.py_buffer(flat)]), seq_length)
    name = lang.encode()
    offsets = np.arange(n + 1, dtype=np.int32) * len(name)
    langs = pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets),
                                                   pa.py_buffer(name * n)])
    batch = pa.record_batch([ids, langs], schema=arrow_schema(seq_length))

    hashed = {}

    def write(f) -> None:  # the IPC stream format: what `datasets.Dataset.from_file` reads
        sink = HashingFile(file=f)  # hashed as written, not read back
        with pa.ipc.new_stream(sink, batch.schema) as w:
            w.write_batch(batch)
        hashed.update(sink.record())

    atomic_write(path, write)
    return {"rows": int(n), "tokens": int(rows.size - np.count_nonzero(rows == pad_id)),
            "language": lang, "bytes": hashed["size"], "sha256": hashed["sha256"]}


def read_manifest(data_dir: str | os.PathLike) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path} not found: {data_dir} is not a finished dataset folder (run "
                        "data_tools/preprocess.py to completion; a rerun resumes).")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise DataError(f"{path} is not readable JSON: {e}; rerun preprocess.py.") from e
    if not isinstance(manifest, dict) or manifest.get("schema_version") != SCHEMA_VERSION:
        version = manifest.get("schema_version") if isinstance(manifest, dict) else None
        raise DataError(f"{path}: schema_version {version!r}, this code "
                        f"reads {SCHEMA_VERSION}; re-create the dataset with this version's "
                        "data_tools/preprocess.py.")
    check_manifest_paths(manifest, Path(data_dir))
    return manifest


def check_manifest_paths(manifest: dict, data_dir: Path) -> None:
    """Every file the manifest names (shards, the word-start table) stays inside `data_dir`
    (`fs.inside`: no absolute path, no `..`, no symlink leading out); checked where every
    reader (training, merging, inspecting) reads the manifest, so none joins an unchecked
    name. A dataset is one folder: a shard elsewhere would be trained on, or a merge would
    write over a file outside its --out."""
    path = data_dir / MANIFEST
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        raise DataError(f"{path}: 'shards' is not a list of shard entries; the file is damaged "
                        "or not ours: re-run preprocess.py.")
    for entry in shards:
        inside(data_dir, entry.get("file"), path, DataError)
    word_starts = manifest.get("word_starts")
    if isinstance(word_starts, dict) and "file" in word_starts:
        inside(data_dir, word_starts["file"], path, DataError)


def check_manifest(manifest: dict, path: str | os.PathLike, tokenizer_sha256: str | None,
                   seq_length: int | None) -> None:
    """Raise DataError if the dataset was made with another tokenizer or sequence length."""
    got = manifest["tokenizer"]["sha256"]
    if tokenizer_sha256 is not None and got != tokenizer_sha256:
        raise DataError(f"{path}: dataset made with tokenizer sha256 {got[:12]}..., but the model "
                        f"uses {tokenizer_sha256[:12]}...; preprocess the corpus with the model's "
                        "tokenizer or point data.path at the matching dataset.")
    if seq_length is not None and manifest["seq_length"] != seq_length:
        raise DataError(f"{path}: dataset has sequence length {manifest['seq_length']}, the run "
                        f"asks for {seq_length}; set the run's seq_length to match or "
                        f"re-run preprocess.py with --seq-length {seq_length}.")


def check_shard_files(data_dir: Path, entries: list[dict]) -> None:
    """Raise DataError naming the first shard in `entries` that is missing or not the size the
    manifest records. Costs one stat per shard: run at start-up for both splits, so that a
    missing validation shard is not found at the first validation, hours in."""
    for entry in entries:
        _check_present(data_dir / entry["file"], entry)


def _check_present(path: Path, entry: dict) -> None:
    """The shard exists and has the size its manifest entry records."""
    if not path.is_file():
        raise DataError(f"shard {path} listed in the manifest is missing; restore it or re-run "
                        "preprocess.py into a new folder.")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise DataError(f"shard {path} has {size} bytes, the manifest says {entry['bytes']} "
                        "(truncated or modified); re-create it with preprocess.py.")


def check_sha256(path: Path, expected: str) -> None:
    """Hash `path` and raise DataError naming it if the digest is not `expected`."""
    try:
        got = sha256_file(path)
    except OSError as e:
        raise DataError(f"shard {path} cannot be read to check its sha256: {e}") from e
    if got != expected:
        raise DataError(f"shard {path}: sha256 differs from the manifest (modified or corrupt); "
                        "re-create it with preprocess.py.")


class _BackgroundChecksums:
    """One daemon thread per process that hashes shards in the order asked, each path once.

    hashlib and file reads release the GIL, so the training thread keeps running. A daemon
    thread, not a ThreadPoolExecutor: the executor would finish every queued hash before the
    process could exit, even after an error."""

    def __init__(self):
        self._lock = threading.Lock()
        self._futures: dict[tuple, Future] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, path: Path, sha256: str) -> Future:
        """A Future that completes when `path` has been hashed: result None if the digest is
        `sha256`, else the DataError naming the file."""
        stat = path.stat()  # a file rewritten since (same path) is hashed again
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, sha256)
        with self._lock:
            if key not in self._futures:
                self._futures[key] = Future()
                self._queue.put((path, sha256, self._futures[key]))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._work, name="shard-sha256",
                                                    daemon=True)
                    self._thread.start()
            return self._futures[key]

    def _work(self) -> None:
        while True:
            path, sha256, future = self._queue.get()
            try:
                check_sha256(path, sha256)
            except Exception as e:  # noqa: BLE001 - any failure goes to the waiting loader,
                future.set_exception(e)  # which would otherwise wait forever
            else:
                future.set_result(None)


CHECKSUMS = _BackgroundChecksums()


def read_shard_batches(path: str | os.PathLike, mmap: bool = True
                       ) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    """The schema and record batches of a shard, memory-mapped (the batches' buffers point
    into the map: nothing is copied; the file must not be rewritten while they live) or, with
    `mmap=False`, read into memory. Shards are written in the Arrow IPC stream format;
    datasets made before that used the IPC file format, which starts with `ARROW1`."""
    source = pa.memory_map(str(path), "r") if mmap else pa.BufferReader(Path(path).read_bytes())
    if source.read(6) == ARROW_FILE_MAGIC:
        source.seek(0)
        reader = pa.ipc.open_file(source)
        return reader.schema, [reader.get_batch(i) for i in range(reader.num_record_batches)]
    source.seek(0)
    reader = pa.ipc.open_stream(source)
    return reader.schema, list(reader)


def open_shard(path: Path, entry: dict, seq_length: int) -> np.ndarray:
    """Memory-map one shard and return its ids as a zero-copy [rows, S] int32 view."""
    _check_present(path, entry)
    try:
        schema, batches = read_shard_batches(path)
        if schema != arrow_schema(seq_length) or len(batches) != 1:
            raise DataError(f"shard {path} has schema {schema} in {len(batches)} batches, "
                            f"expected {arrow_schema(seq_length)} in 1; it was not written by "
                            "preprocess.py for this sequence length.")
        ids = batches[0].column(0)
        flat = ids.values.to_numpy(zero_copy_only=True)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"shard {path} is not a readable Arrow file ({e}); re-create it.") from e
    if len(ids) != entry["rows"] or ids.null_count or len(flat) != entry["rows"] * seq_length:
        raise DataError(f"shard {path} has {len(ids)} rows, the manifest says {entry['rows']}.")
    return flat.reshape(entry["rows"], seq_length)


class ShardDataset:
    """The rows of one split, grouped by language, memory-mapped on first use.

    Picklable: worker processes re-open the files themselves (the maps are not copied); the
    background sha256 checks stay with the process that created the dataset."""

    def __init__(self, data_dir: str | os.PathLike, split: str = "train",
                 tokenizer_sha256: str | None = None, seq_length: int | None = None,
                 verify_checksums: bool = False, verify_in_background: bool = False):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.data_dir = Path(data_dir)
        self.manifest = read_manifest(data_dir)
        check_manifest(self.manifest, self.data_dir / MANIFEST, tokenizer_sha256, seq_length)
        self.split = split
        self.seq_length: int = self.manifest["seq_length"]
        self.special_ids = SpecialIds.from_dict(self.manifest["special_ids"])
        self.vocab_size: int = self.manifest["tokenizer"]["vocab_size"]
        entries = [s for s in self.manifest["shards"] if s["split"] == split]
        self.languages: list[str] = sorted({s["language"] for s in entries})
        self._entries = {lang: [s for s in entries if s["language"] == lang]
                         for lang in self.languages}
        self.rows_per_language = {lang: sum(s["rows"] for s in es)
                                  for lang, es in self._entries.items()}
        self.tokens_per_language = {lang: sum(s["tokens"] for s in es)
                                    for lang, es in self._entries.items()}
        check_shard_files(self.data_dir, self.manifest["shards"])  # both splits
        # Shard k of this split in `languages` order; rows of language i live in shards
        # first_shard[i], first_shard[i] + 1, ...
        self._files = [self.data_dir / s["file"] for lang in self.languages
                       for s in self._entries[lang]]
        self._first_shard = np.cumsum([0] + [len(self._entries[x]) for x in self.languages])
        if verify_checksums:
            for s in entries:
                check_sha256(self.data_dir / s["file"], s["sha256"])
        self._checks: list[Future] | None = None
        if verify_in_background:
            self._checks = [CHECKSUMS.submit(self.data_dir / s["file"], s["sha256"])
                            for lang in self.languages for s in self._entries[lang]]
            # The other split next, so that its reader finds them done (each file once).
            for s in self.manifest["shards"]:
                if s["split"] != split:
                    CHECKSUMS.submit(self.data_dir / s["file"], s["sha256"])
        self._arrays: dict[str, list[np.ndarray]] | None = None
        self._open()  # fail now, in the main process, rather than in a loader worker

    def _open(self) -> None:
        self._arrays = {lang: [open_shard(self.data_dir / s["file"], s, self.seq_length)
                               for s in es] for lang, es in self._entries.items()}
        self._offsets = {lang: np.cumsum([0] + [a.shape[0] for a in arrs])
                         for lang, arrs in self._arrays.items()}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_arrays"] = None
        state["_checks"] = None  # Futures of this process's checksum thread
        return state

    def shard_numbers(self, lang_idx: np.ndarray, row_idx: np.ndarray) -> np.ndarray:
        """Shard k (an index into this split's shards) holding each (language, row) pair."""
        if self._arrays is None:
            self._open()
        out = np.empty(len(lang_idx), dtype=np.int64)
        for li in np.unique(lang_idx).tolist():
            sel = lang_idx == li
            offsets = self._offsets[self.languages[li]]
            out[sel] = self._first_shard[li] + np.searchsorted(offsets, row_idx[sel], "right") - 1
        return out

    @property
    def verifying(self) -> bool:
        """True while background sha256 checks of this split are pending (or failed)."""
        return self._checks is not None

    def wait_verified(self, lang_idx: np.ndarray, row_idx: np.ndarray) -> None:
        """Block until the background sha256 checks of the shards holding these rows have
        passed; raise the DataError naming the file if any check of this split has failed.
        A no-op without `verify_in_background` (and in loader workers)."""
        if self._checks is None:
            return
        for future in self._checks:
            if future.done() and future.exception() is not None:
                raise future.exception()
        for k in np.unique(self.shard_numbers(lang_idx, row_idx)).tolist():
            self._checks[k].result()
        if all(f.done() for f in self._checks):
            for future in self._checks:
                future.result()  # a check that failed since the loop above
            self._checks = None  # every shard verified: nothing left to wait for

    def word_starts(self) -> np.ndarray:
        """[V] bool table for whole-word masking, written by preprocess.py."""
        path = self.data_dir / WORD_STARTS
        try:
            table = np.load(path)  # allow_pickle=False: a pickled object is refused, never run
        except (OSError, ValueError) as err:
            raise DataError(f"{path}: not a plain .npy array ({err}); re-run "
                            "preprocess.py.") from None
        if table.shape != (self.vocab_size,) or table.dtype != bool:
            raise DataError(f"{path} has shape {table.shape} {table.dtype}, expected "
                            f"({self.vocab_size},) bool; re-run preprocess.py.")
        return table

    def get(self, lang_idx: np.ndarray, row_idx: np.ndarray) -> np.ndarray:
        """Rows for (language index into `self.languages`, row within that language) pairs.
        Returns a new [B, S] int32 array (copied out of the maps)."""
        if self._arrays is None:
            self._open()
        out = np.empty((len(lang_idx), self.seq_length), dtype=np.int32)
        for k, (li, ri) in enumerate(zip(lang_idx.tolist(), row_idx.tolist(), strict=True)):
            lang = self.languages[li]
            s = int(np.searchsorted(self._offsets[lang], ri, side="right")) - 1
            out[k] = self._arrays[lang][s][ri - self._offsets[lang][s]]
        # One pass: as unsigned, a negative id is also >= vocab_size.
        if out.size and out.view(np.uint32).max() >= self.vocab_size:
            self._raise_out_of_range(out, lang_idx, row_idx)
        return out

    def _raise_out_of_range(self, out: np.ndarray, lang_idx: np.ndarray,
                            row_idx: np.ndarray) -> None:
        k, position = np.argwhere(out.view(np.uint32) >= self.vocab_size)[0].tolist()
        shard = int(self.shard_numbers(lang_idx[k:k + 1], row_idx[k:k + 1])[0])
        lang = self.languages[int(lang_idx[k])]
        row = int(row_idx[k]) - int(self._offsets[lang][shard - self._first_shard[lang_idx[k]]])
        raise DataError(f"shard {self._files[shard]} row {row}: token id {out[k, position]} at "
                        f"position {position} is outside the vocabulary [0, {self.vocab_size}) "
                        "(corrupt, or from another dataset); re-create it with preprocess.py.")

    def __len__(self) -> int:
        return sum(self.rows_per_language.values())

    def iter_rows(self):
        """All rows in manifest order: (language, [S] int32 view)."""
        if self._arrays is None:
            self._open()
        for lang in self.languages:
            for arr in self._arrays[lang]:
                yield from ((lang, row) for row in arr)
