"""Packer.add_many (one call per batch of documents) makes the rows of per-document `add`."""

import numpy as np

from megatron_rembert.data.common import SpecialIds
from megatron_rembert.prep.packing import Packer


def _packer(carried: int, rng) -> Packer:
    return Packer(8, SpecialIds(), rng.integers(10, 99, carried).astype(np.int32),
                  np.zeros((0, 8), np.int32))


def test_add_many_equals_add_one_by_one():
    rng = np.random.default_rng(0)
    for _ in range(300):
        # short documents (empty ones too) around the 6-token row content, any carry-over:
        # every case of `add` (fresh row, [SEP] first, flush when 5 tokens are carried)
        lengths = rng.integers(0, 14, rng.integers(0, 12))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = rng.integers(10, 99, int(offsets[-1])).astype(np.int32)
        carried = int(rng.integers(0, 6))
        one, many = _packer(carried, np.random.default_rng(1)), _packer(carried,
                                                                         np.random.default_rng(1))
        for i in range(len(lengths)):
            one.add(flat[offsets[i]:offsets[i + 1]])
        many.add_many(flat, offsets)
        np.testing.assert_array_equal(many.buf, one.buf)
        np.testing.assert_array_equal(many.take(many.n_rows), one.take(one.n_rows))
