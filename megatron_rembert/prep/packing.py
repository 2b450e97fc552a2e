"""Packing one language's documents into fixed-length rows.

The documents form one stream `d1 [SEP] d2 [SEP] ...`, cut into pieces of S-2 tokens, each
stored as `[CLS] piece [SEP]` (a long document spans several rows). Only the last row of a
language (or a row with no room left for `[SEP]` + text) is padded with [PAD].
"""

from __future__ import annotations

import numpy as np

from megatron_rembert.data.common import SpecialIds


class Packer:
    """Packs documents of one language and split into [S] int32 rows."""

    def __init__(self, seq_length: int, ids: SpecialIds, buf: np.ndarray, rows: np.ndarray):
        self.S, self.ids, self.buf = seq_length, ids, buf.astype(np.int32)
        self.rows = [rows.astype(np.int32)] if len(rows) else []

    @property
    def rows(self) -> list[np.ndarray]:
        return self._rows

    @rows.setter
    def rows(self, value: list[np.ndarray]) -> None:
        self._rows = value
        self._n_rows = sum(len(r) for r in value)

    @property
    def n_rows(self) -> int:
        # Kept as a running count: the caller asks after every document, and summing over a
        # list that grows with every document made preprocessing quadratic in the shard size.
        return self._n_rows

    def _append(self, rows: np.ndarray) -> None:
        self._rows.append(rows)
        self._n_rows += len(rows)

    def _make(self, pieces: np.ndarray) -> np.ndarray:  # [n, S-2] -> [n, S]
        out = np.empty((len(pieces), self.S), dtype=np.int32)  # every column is set below
        out[:, 0], out[:, 1:-1], out[:, -1] = self.ids.cls, pieces, self.ids.sep
        return out

    def add(self, doc: np.ndarray) -> None:
        content = self.S - 2
        if len(self.buf) + 1 >= content:
            self.flush_partial()  # no room for [SEP] + text: avoid a row ending in [SEP] [SEP]
        sep = [np.array([self.ids.sep], np.int32)] if len(self.buf) else []
        buf = np.concatenate([self.buf, *sep, np.asarray(doc, dtype=np.int32)])
        n = len(buf) // content
        if n:
            self._append(self._make(buf[: n * content].reshape(n, content)))
        self.buf = buf[n * content:].copy()

    def add_many(self, flat: np.ndarray, offsets: np.ndarray) -> None:
        """`add` of every document flat[offsets[i]:offsets[i+1]], in order: the same rows,
        computed per run of documents rather than per document. Within a run every document
        after the first gets a [SEP] and nothing is flushed; a run ends before the first
        document that would find the carried tokens at a row's start (no [SEP]) or one short
        of its end (a flush), found with one cumulative sum; S-2 tokens apart, these are rare."""
        content = self.S - 2
        offsets = np.asarray(offsets, np.int64)
        lengths = np.diff(offsets)
        i, n = 0, len(lengths)
        while i < n:
            if len(self.buf) + 1 >= content:  # as in `add`: no room for [SEP] + text
                self.flush_partial()
            rem = len(self.buf)
            # the carried length before document i+1+t, were it still in this run
            before = (rem + (rem > 0) + np.cumsum(lengths[i:-1]) + np.arange(n - 1 - i)) % content
            stop = np.flatnonzero((before == 0) | (before == content - 1))
            k = i + 1 + int(stop[0]) if len(stop) else n
            seps = offsets[i + 1:k] if rem == 0 else offsets[i:k]
            self._add_stream(flat[offsets[i]:offsets[k]], seps, int(offsets[i]))
            i = k

    def _add_stream(self, tokens: np.ndarray, seps: np.ndarray, origin: int) -> None:
        """Append `tokens` ([SEP] inserted before the flat positions `seps`; tokens[0] is at
        `origin`) to the carried tokens and cut the full rows."""
        content = self.S - 2
        stream = np.insert(np.asarray(tokens, np.int32), np.asarray(seps, np.int64) - origin,
                           np.int32(self.ids.sep))
        buf = np.concatenate([self.buf, stream])
        n = len(buf) // content
        if n:
            self._append(self._make(buf[: n * content].reshape(n, content)))
        self.buf = buf[n * content:].copy()

    def flush_partial(self) -> None:
        """Emit the carried-over tokens as one padded row (end of a language)."""
        if len(self.buf):
            row = np.full((1, self.S), self.ids.pad, dtype=np.int32)
            row[0, 0], row[0, 1: 1 + len(self.buf)] = self.ids.cls, self.buf
            row[0, 1 + len(self.buf)] = self.ids.sep
            self._append(row)
            self.buf = np.zeros(0, np.int32)

    def take(self, n: int) -> np.ndarray:
        rows = np.concatenate(self.rows) if self.rows else np.zeros((0, self.S), np.int32)
        self.rows = [rows[n:]] if len(rows) > n else []
        return rows[:n]
