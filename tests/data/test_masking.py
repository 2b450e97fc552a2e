"""MLM masking: 15% with 80/10/10, specials and padding never masked, pure in (seed, index),
whole words together."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_rembert.data.masking import (
    MaskingConfig,
    default_max_predictions,
    mask_batch,
    mask_sequence,
)

V, S = 1000, 128


def _rows(n: int, seed: int = 0) -> np.ndarray:
    """[n, S] rows like the packer makes: [CLS] text [SEP] text [SEP] [PAD]..."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, V, size=(n, S))
    ids[:, 0], ids[:, 40], ids[:, 99] = 2, 3, 3
    ids[:, 100:] = 0
    ids[::3, 50] = 1  # [UNK] is ordinary text
    return ids


def test_default_width():
    assert default_max_predictions(512) == 80 and default_max_predictions(128) == 24


def test_statistics_and_specials():
    cfg = MaskingConfig(vocab_size=V, max_predictions=default_max_predictions(S), seed=1)
    ids = _rows(2000)
    b = mask_batch(ids, np.arange(2000), cfg)
    assert b["masked_positions"].shape == (2000, 24) and b["masked_weights"].dtype == np.float32
    cand = ~np.isin(ids, [0, 2, 3, 4])
    n_masked = b["masked_weights"].sum(1)
    np.testing.assert_array_equal(n_masked, np.round(cand.sum(1) * 0.15))
    w = b["masked_weights"] > 0
    pos, lab = b["masked_positions"][w], b["masked_labels"][w]
    rows = np.nonzero(w)[0]
    assert cand[rows, pos].all()  # only candidates: never [CLS], [SEP], [PAD]
    np.testing.assert_array_equal(lab, ids[rows, pos])
    new = b["input_ids"][rows, pos]
    frac_mask = (new == 4).mean()
    frac_same = (new == lab).mean()
    frac_rand = 1 - frac_mask - frac_same
    assert abs(frac_mask - 0.8) < 0.01 and abs(frac_rand - 0.1) < 0.01
    assert abs(frac_same - 0.1) < 0.01
    assert (new[(new != 4) & (new != lab)] >= 5).all()  # random tokens are never special
    # unmasked positions are untouched; padding slots of positions/labels are 0
    untouched = np.ones_like(ids, dtype=bool)
    untouched[rows, pos] = False
    np.testing.assert_array_equal(b["input_ids"][untouched], ids[untouched])
    assert (b["masked_positions"][~w] == 0).all() and (b["masked_labels"][~w] == 0).all()
    np.testing.assert_array_equal(b["attention_mask"], (ids != 0).astype(np.int64))
    assert b["attention_mask"].dtype == np.int64
    assert (b["token_type_ids"] == 0).all()


def test_pure_in_seed_and_index():
    cfg = MaskingConfig(vocab_size=V, max_predictions=24, seed=5)
    ids = _rows(8)
    a = mask_batch(ids, np.arange(100, 108), cfg)
    # the same sample in another batch, at another position, gets the same mask
    b = mask_batch(ids[[7, 3]], np.array([107, 103]), cfg)
    for k in (k for k in a if k != "unpadded"):  # per row; `unpadded` is the micro-batch's
        np.testing.assert_array_equal(a[k][[7, 3]], b[k])
    c = mask_sequence(ids[0], 101, cfg)[1]
    assert not np.array_equal(c, a["masked_positions"][0])  # another index, another mask
    d = mask_sequence(ids[0], 100, MaskingConfig(vocab_size=V, max_predictions=24, seed=6))[1]
    assert not np.array_equal(d, a["masked_positions"][0])  # another seed, another mask


def test_whole_word_masking():
    word_starts = np.zeros(V, dtype=bool)
    word_starts[5:500] = True  # ids 5..499 start a word, 500.. continue one
    rng = np.random.default_rng(0)
    ids = _rows(300)
    cont = rng.random(ids.shape) < 0.5
    ids = np.where(cont & (ids >= 5), rng.integers(500, V, ids.shape), ids)
    cfg = MaskingConfig(vocab_size=V, max_predictions=24, seed=2, whole_word_mask=True)
    b = mask_batch(ids, np.arange(300), cfg, word_starts)
    cand = ~np.isin(ids, [0, 2, 3, 4])
    total = 0
    for i in range(300):
        m = b["masked_positions"][i][b["masked_weights"][i] > 0]
        total += len(m)
        masked = np.zeros(S, bool)
        masked[m] = True
        # a word is a start piece (or first token after a special) + following pieces
        start = cand[i] & (word_starts[ids[i]] | ~np.concatenate([[False], cand[i][:-1]]))
        wid = np.cumsum(start)
        for w in np.unique(wid[masked]):
            members = cand[i] & (wid == w)
            if members.sum() <= cfg.max_word_pieces:
                assert masked[members].all(), f"row {i}: word {w} partly masked"
    k = np.round(cand.sum(1) * 0.15).sum()  # the per-row budget; words never overshoot it
    assert 0.95 * k <= total <= k


def test_wwm_needs_table():
    cfg = MaskingConfig(vocab_size=V, max_predictions=24, whole_word_mask=True)
    with pytest.raises(ValueError, match="word_starts"):
        mask_sequence(_rows(1)[0], 0, cfg)
