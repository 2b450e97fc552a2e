"""Preprocessing gives the same dataset whatever the number of workers and the block size."""

from __future__ import annotations

import json

from megatron_rembert.prep.preprocess import preprocess
from tests.data.conftest import small_config


def _shards(manifest: dict) -> list[tuple]:
    return [(s["file"], s["rows"], s["tokens"], s["sha256"]) for s in manifest["shards"]
            if s["split"] == "train"]


def test_workers_and_block_size_do_not_change_the_train_shards(corpus, tokenizer, dataset,
                                                                 tmp_path):
    """The reference is the session dataset (1 worker, the default 1 MiB blocks). Validation
    shards are cut at checkpoints, which fall at block ends, so only their concatenation is
    compared."""
    reference = json.loads((dataset / "manifest.json").read_text())
    for workers, block in ((0, 1 << 18), (2, 3000)):
        m = preprocess(small_config(corpus, tmp_path / f"w{workers}", tokenizer, workers=workers,
                                    block_bytes=block))
        assert _shards(m) == _shards(reference), (workers, block)
        assert m["languages"] == reference["languages"] and m["skipped"] == reference["skipped"]


def test_both_encoders_give_sentencepiece_ids(tokenizer):
    """The worker's joined-buffer encoder (private SentencePiece method, probed at start-up) and
    its fallback over Python ints both equal the public `sp.encode`, flattened."""
    from megatron_rembert.prep import preprocess as pre
    from megatron_rembert.prep.tokenizer import load_sentencepiece

    sp = load_sentencepiece(tokenizer)
    texts = ["da kepuga muhebova ha votuzu.", "", "на зату мятипо фы дыли шесу.", "x" * 300]
    want = sp.encode(texts)
    encoders = [pre._list_encoder(sp)]
    if hasattr(sp, "EncodeAsNumpy"):  # the buffers exist since SentencePiece 0.2.1
        encoders.append(pre._buffer_encoder(sp))
        assert encoders[-1] is not None, "the probe refused SentencePiece's buffer encoder"
    for encode in encoders:
        flat, offsets = encode(texts)
        assert flat.dtype == "int32" and offsets.tolist()[-1] == len(flat)
        assert [flat[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)] == want
