"""BERT-style MLM masking as a pure function of (seed, global sample index).

For sample i the generator is rng(seed, 2, i) (see `sampler.rng_for`), so a sample gets the
same mask whatever the parallel layout, worker count or resume point.

Per sequence: candidates are all tokens except [PAD], [CLS], [SEP] and [MASK];
k = min(P, max(1, round(mask_prob * n_candidates))) of them are chosen (whole words when
`whole_word_mask`), then 80% become [MASK], 10% a random non-special token, 10% stay as they
are (Devlin et al. 2019). Whole words: a word starts at a piece beginning with U+2581 or at the
first token after a special one; words are taken in random order, skipping any that would
overshoot k. Scripts written without spaces (Chinese, Japanese, Thai) rarely carry U+2581, so a
"word" longer than `max_word_pieces` is masked piece by piece instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_rembert.data.common import SpecialIds
from megatron_rembert.data.sampler import rng_for

MASK_STREAM = 2  # the rng_for tag of the masking stream (0, 1: sampler)


def default_max_predictions(seq_length: int, mask_prob: float = 0.15) -> int:
    """P: room for every prediction of a full row, rounded up to a multiple of 8 (512 -> 80)."""
    return 8 * math.ceil(math.ceil(seq_length * mask_prob) / 8)


@dataclass(frozen=True)
class MaskingConfig:
    vocab_size: int
    max_predictions: int  # P
    seed: int = 0
    mask_prob: float = 0.15
    replace_prob: float = 0.8  # -> [MASK]
    random_prob: float = 0.1  # -> random token; the rest keep the original
    whole_word_mask: bool = False
    max_word_pieces: int = 8
    special_ids: SpecialIds = SpecialIds()

    @property
    def first_regular_id(self) -> int:
        # random replacements come from [first_regular_id, vocab_size): never a special token
        return max(self.special_ids.to_dict().values()) + 1


def _word_ids(ids: np.ndarray, cand: np.ndarray, word_starts: np.ndarray,
              max_word_pieces: int) -> np.ndarray:
    """[S] word number of each candidate token (-1 for non-candidates)."""
    prev = np.concatenate([[False], cand[:-1]])
    starts = cand & (word_starts[ids] | ~prev)
    wid = np.cumsum(starts) - 1
    lengths = np.bincount(wid[cand], minlength=max(int(wid.max()) + 1, 1))
    long_word = cand & (lengths[np.maximum(wid, 0)] > max_word_pieces)
    starts |= long_word
    wid = np.cumsum(starts) - 1
    return np.where(cand, wid, -1)


def _choose(ids: np.ndarray, cand: np.ndarray, k: int, rng: np.random.Generator,
            cfg: MaskingConfig, word_starts: np.ndarray | None) -> np.ndarray:
    positions = np.flatnonzero(cand)
    if not cfg.whole_word_mask:
        return np.sort(rng.choice(positions, size=k, replace=False))
    wid = _word_ids(ids, cand, word_starts, cfg.max_word_pieces)[positions]
    lengths = np.bincount(wid)
    chosen, covered = [], 0
    for w in rng.permutation(len(lengths)).tolist():
        if covered + lengths[w] <= k:
            chosen.append(w)
            covered += int(lengths[w])
            if covered == k:
                break
    return positions[np.isin(wid, chosen)]


def mask_sequence(ids: np.ndarray, index: int, cfg: MaskingConfig,
                  word_starts: np.ndarray | None = None):
    """Mask one row. ids [S] int -> (masked ids [S] int64, positions [P], labels [P],
    weights [P] float32); positions/labels padded with 0, weights with 0.0."""
    if cfg.whole_word_mask and word_starts is None:
        raise ValueError("whole_word_mask needs the word_starts table (ShardDataset.word_starts)")
    ids = np.asarray(ids, dtype=np.int64)
    rng = rng_for(cfg.seed, MASK_STREAM, int(index))
    cand = ~np.isin(ids, cfg.special_ids.never_masked())
    n = int(cand.sum())
    k = 0 if n == 0 else min(cfg.max_predictions, max(1, int(n * cfg.mask_prob + 0.5)))
    out = ids.copy()
    P = cfg.max_predictions
    positions, labels = np.zeros(P, np.int64), np.zeros(P, np.int64)
    weights = np.zeros(P, np.float32)
    if k == 0:
        return out, positions, labels, weights
    chosen = _choose(ids, cand, k, rng, cfg, word_starts)
    u = rng.random(len(chosen))
    random_ids = rng.integers(cfg.first_regular_id, cfg.vocab_size, len(chosen))
    new = np.where(u < cfg.replace_prob, cfg.special_ids.mask,
                   np.where(u < cfg.replace_prob + cfg.random_prob, random_ids, ids[chosen]))
    out[chosen] = new
    m = len(chosen)
    positions[:m], labels[:m], weights[:m] = chosen, ids[chosen], 1.0
    return out, positions, labels, weights


def mask_batch(ids: np.ndarray, indices: np.ndarray, cfg: MaskingConfig,
               word_starts: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """ids [B, S] + global sample indices [B] -> the batch dict:
    input_ids [B,S] int64, attention_mask [B,S] float32 (1 real, 0 pad), token_type_ids [B,S]
    int64 (zeros), masked_positions [B,P] int64, masked_labels [B,P] int64,
    masked_weights [B,P] float32."""
    rows = [mask_sequence(r, i, cfg, word_starts) for r, i in zip(ids, indices, strict=True)]
    input_ids, positions, labels, weights = (np.stack(x) for x in zip(*rows, strict=True))
    return {
        "input_ids": input_ids,
        "attention_mask": (np.asarray(ids) != cfg.special_ids.pad).astype(np.float32),
        "token_type_ids": np.zeros_like(input_ids),
        "masked_positions": positions,
        "masked_labels": labels,
        "masked_weights": weights,
    }
