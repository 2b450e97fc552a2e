"""Preprocessing gives the same dataset whatever the number of workers and the block size."""

from __future__ import annotations

import json

from megatron_rembert.data.preprocess import preprocess
from tests.data.conftest import small_config


def _shards(manifest: dict) -> list[tuple]:
    return [(s["file"], s["rows"], s["tokens"], s["sha256"]) for s in manifest["shards"]
            if s["split"] == "train"]


def test_workers_and_block_size_do_not_change_the_train_shards(corpus, tokenizer, dataset,
                                                                 tmp_path):
    """The reference is the session dataset (1 worker, 256 KiB blocks). Validation shards are
    cut at checkpoints, which fall at block ends, so only their concatenation is compared."""
    reference = json.loads((dataset / "manifest.json").read_text())
    for workers, block in ((0, 1 << 18), (2, 3000)):
        m = preprocess(small_config(corpus, tmp_path / f"w{workers}", tokenizer, workers=workers,
                                    block_bytes=block))
        assert _shards(m) == _shards(reference), (workers, block)
        assert m["languages"] == reference["languages"] and m["skipped"] == reference["skipped"]
