"""The shard format and its memory-mapped, zero-copy reader.

A dataset folder holds `manifest.json`, `word_starts.npy` and `<split>/<lang>/*.arrow`: Arrow
IPC files (uncompressed, one record batch each) with columns `input_ids` (fixed-size list of
int32, length = sequence length) and `lang` (string). The manifest is written last, atomically,
so a folder without one is unfinished; the reader opens only the shards the manifest lists and
checks each one's size, schema and row count against it (`verify_checksums` adds sha256).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from megatron_rembert.data.common import DataError, SpecialIds, atomic_write, sha256_file

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
WORD_STARTS = "word_starts.npy"
SPLITS = ("train", "valid")


def arrow_schema(seq_length: int) -> pa.Schema:
    return pa.schema([pa.field("input_ids", pa.list_(pa.int32(), seq_length), nullable=False),
                      pa.field("lang", pa.string(), nullable=False)])


def write_shard(path: str | os.PathLike, rows: np.ndarray, lang: str, pad_id: int) -> dict:
    """Atomically write `rows` ([n, S] int32) as one shard; return its manifest entry
    (without the `file` key): rows, tokens (non-pad), bytes, sha256."""
    n, seq_length = rows.shape
    ids = pa.FixedSizeListArray.from_arrays(
        pa.array(np.ascontiguousarray(rows, dtype=np.int32).reshape(-1)), seq_length)
    batch = pa.record_batch([ids, pa.array([lang] * n, pa.string())],
                            schema=arrow_schema(seq_length))

    def write(f) -> None:
        with pa.ipc.new_file(f, batch.schema) as w:
            w.write_batch(batch)

    atomic_write(path, write)
    return {"rows": int(n), "tokens": int((rows != pad_id).sum()), "language": lang,
            "bytes": os.path.getsize(path), "sha256": sha256_file(path)}


def read_manifest(data_dir: str | os.PathLike) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path} not found: {data_dir} is not a finished dataset folder (run "
                        "data_tools/preprocess.py to completion; a rerun resumes).")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise DataError(f"{path} is not readable JSON: {e}; rerun preprocess.py.") from e
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise DataError(f"{path}: schema_version {manifest.get('schema_version')!r}, this code "
                        f"reads {SCHEMA_VERSION}; re-create the dataset with this version's "
                        "data_tools/preprocess.py.")
    return manifest


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


def open_shard(path: Path, entry: dict, seq_length: int) -> np.ndarray:
    """Memory-map one shard and return its ids as a zero-copy [rows, S] int32 view."""
    if not path.is_file():
        raise DataError(f"shard {path} listed in the manifest is missing; restore it or re-run "
                        "preprocess.py into a new folder.")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise DataError(f"shard {path} has {size} bytes, the manifest says {entry['bytes']} "
                        "(truncated or modified); re-create it with preprocess.py.")
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        if reader.schema != arrow_schema(seq_length) or reader.num_record_batches != 1:
            raise DataError(f"shard {path} has schema {reader.schema} in "
                            f"{reader.num_record_batches} batches, expected "
                            f"{arrow_schema(seq_length)} in 1; it was not written by "
                            "preprocess.py for this sequence length.")
        ids = reader.get_batch(0).column(0)
        flat = ids.values.to_numpy(zero_copy_only=True)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"shard {path} is not a readable Arrow file ({e}); re-create it.") from e
    if len(ids) != entry["rows"] or ids.null_count or len(flat) != entry["rows"] * seq_length:
        raise DataError(f"shard {path} has {len(ids)} rows, the manifest says {entry['rows']}.")
    return flat.reshape(entry["rows"], seq_length)


class ShardDataset:
    """The rows of one split, grouped by language, memory-mapped on first use.

    Picklable: worker processes re-open the files themselves (the maps are not copied)."""

    def __init__(self, data_dir: str | os.PathLike, split: str = "train",
                 tokenizer_sha256: str | None = None, seq_length: int | None = None,
                 verify_checksums: bool = False):
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
        if verify_checksums:
            for s in entries:
                if sha256_file(self.data_dir / s["file"]) != s["sha256"]:
                    raise DataError(f"shard {self.data_dir / s['file']}: sha256 differs from the "
                                    "manifest (modified or corrupt); re-create it.")
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
        return state

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
        return out

    def __len__(self) -> int:
        return sum(self.rows_per_language.values())

    def iter_rows(self):
        """All rows in manifest order: (language, [S] int32 view)."""
        if self._arrays is None:
            self._open()
        for lang in self.languages:
            for arr in self._arrays[lang]:
                yield from ((lang, row) for row in arr)
