"""BERT-style MLM masking as a pure function of (seed, global sample index).

For sample i the generator is rng(seed, 2, i) (see `sampler.rng_for`), so a sample gets the
same mask whatever the parallel layout, worker count or resume point. Under a mask-rate schedule
(`data/schedule.py`) each row also gets the rate of the step its sample belongs to
(`mask_probs`), itself a function of the sample index.

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

from megatron_rembert.data import batch
from megatron_rembert.data.common import SpecialIds
from megatron_rembert.data.config import DataConfig
from megatron_rembert.data.sampler import rng_for

MASK_STREAM = 2  # the rng_for tag of the masking stream (0, 1: sampler)


def default_max_predictions(seq_length: int, mask_prob: float = DataConfig.mask_prob) -> int:
    """P: room for every prediction of a full row, rounded up to a multiple of 8 (512 -> 80)."""
    return 8 * math.ceil(math.ceil(seq_length * mask_prob) / 8)


def masked_count(candidates: int, mask_prob: float) -> int:
    """Tokens masked in a row of `candidates` maskable tokens at `mask_prob` (at least one
    where there is a candidate), before the cap P."""
    return 0 if candidates == 0 else max(1, int(candidates * mask_prob + 0.5))


@dataclass(frozen=True)
class MaskingConfig:
    vocab_size: int
    max_predictions: int  # P
    seed: int = 0
    mask_prob: float = DataConfig.mask_prob
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


def _greedy_words(order: np.ndarray, lengths: np.ndarray, k: int) -> list[int]:
    """Words in `order`, each taken if it still fits in k pieces, until exactly k are covered.

    Same result as the plain loop over `order`, but the leading run of words that all fit
    (usually most of them) is found with one cumsum; Python only walks the tail after the first
    word that would overshoot."""
    cum = np.cumsum(lengths[order])
    j = int(np.searchsorted(cum, k, side="right"))  # order[:j] fit, order[j] would overshoot
    chosen = order[:j].tolist()
    covered = int(cum[j - 1]) if j else 0
    if covered == k:
        return chosen
    for w in order[j:].tolist():
        if covered + lengths[w] <= k:
            chosen.append(w)
            covered += int(lengths[w])
            if covered == k:
                break
    return chosen


def _batch_word_ids(ids: np.ndarray, cand: np.ndarray, word_starts: np.ndarray,
                    max_word_pieces: int) -> np.ndarray:
    """[B, S] `_word_ids` of every row at once (numbering restarts at 0 in each row): the same
    steps on the flattened batch, where word numbers simply run on across rows."""
    prev = np.zeros_like(cand)
    prev[:, 1:] = cand[:, :-1]  # False at each row's start: a row never continues a word
    starts = (cand & (word_starts[ids] | ~prev)).ravel()
    flat_cand = cand.ravel()
    wid = np.cumsum(starts) - 1
    lengths = np.bincount(wid[flat_cand], minlength=max(int(wid.max()) + 1, 1))
    starts |= flat_cand & (lengths[np.maximum(wid, 0)] > max_word_pieces)
    wid = (np.cumsum(starts) - 1).reshape(cand.shape)
    # a row's first candidate always starts a word, so its number is the row's first number
    first = np.cumsum(starts.reshape(cand.shape).sum(1)) - starts.reshape(cand.shape).sum(1)
    return np.where(cand, wid - first[:, None], -1)


def _choose(ids: np.ndarray, cand: np.ndarray, k: int, rng: np.random.Generator,
            cfg: MaskingConfig, word_starts: np.ndarray | None,
            word_ids: np.ndarray | None = None) -> np.ndarray:
    positions = np.flatnonzero(cand)
    if not cfg.whole_word_mask:
        return np.sort(rng.choice(positions, size=k, replace=False))
    if word_ids is None:
        word_ids = _word_ids(ids, cand, word_starts, cfg.max_word_pieces)
    wid = word_ids[positions]
    lengths = np.bincount(wid)
    chosen = _greedy_words(rng.permutation(len(lengths)), lengths, k)
    # boolean lookup instead of np.isin(wid, chosen): same positions, no sort of `chosen`
    taken = np.zeros(len(lengths), dtype=bool)
    taken[chosen] = True
    return positions[taken[wid]]


def _candidates(ids: np.ndarray, cfg: MaskingConfig) -> np.ndarray:
    """Bool mask (any shape) of maskable tokens: not PAD, CLS, SEP or MASK. Four compares
    instead of np.isin, which sorts and costs more than the masking itself for one row."""
    never = cfg.special_ids.never_masked()
    cand = ids != never[0]
    for t in never[1:]:
        cand &= ids != t
    return cand


def _mask_row(ids: np.ndarray, cand: np.ndarray, index: int, cfg: MaskingConfig,
              word_starts: np.ndarray | None, first_regular: int,
              word_ids: np.ndarray | None = None, mask_prob: float | None = None):
    """The random part of masking one row: (chosen positions, their new ids), or None when
    the row has no candidate. `ids` int64 [S], `cand` its candidate mask; `mask_prob`
    replaces cfg.mask_prob (a scheduled rate)."""
    rng = rng_for(cfg.seed, MASK_STREAM, int(index))
    n = int(cand.sum())
    rate = cfg.mask_prob if mask_prob is None else mask_prob
    k = min(cfg.max_predictions, masked_count(n, rate))
    if k == 0:
        return None
    chosen = _choose(ids, cand, k, rng, cfg, word_starts, word_ids)
    u = rng.random(len(chosen))
    random_ids = rng.integers(first_regular, cfg.vocab_size, len(chosen))
    new = np.where(u < cfg.replace_prob, cfg.special_ids.mask,
                   np.where(u < cfg.replace_prob + cfg.random_prob, random_ids, ids[chosen]))
    return chosen, new


def mask_sequence(ids: np.ndarray, index: int, cfg: MaskingConfig,
                  word_starts: np.ndarray | None = None):
    """Mask one row. ids [S] int -> (masked ids [S], positions [P], labels [P], weights [P]),
    each row of its batch key (`batch.FIELDS`); positions/labels padded with 0, weights with 0.0.
    """
    if cfg.whole_word_mask and word_starts is None:
        raise ValueError("whole_word_mask needs the word_starts table (ShardDataset.word_starts)")
    ids = np.asarray(ids, dtype=batch.FIELDS["input_ids"].dtype)
    out = ids.copy()
    S, P = len(ids), cfg.max_predictions
    positions, labels, weights = (batch.zeros(key, 1, S, P)[0] for key in
                                  ("masked_positions", "masked_labels", "masked_weights"))
    picked = _mask_row(ids, _candidates(ids, cfg), index, cfg, word_starts, cfg.first_regular_id)
    if picked is None:
        return out, positions, labels, weights
    chosen, new = picked
    out[chosen] = new
    m = len(chosen)
    positions[:m], labels[:m], weights[:m] = chosen, ids[chosen], 1.0
    return out, positions, labels, weights


def mask_batch(ids: np.ndarray, indices: np.ndarray, cfg: MaskingConfig,
               word_starts: np.ndarray | None = None,
               mask_probs: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """ids [B, S] + global sample indices [B] (+ each row's mask rate [B], default
    cfg.mask_prob) -> the micro-batch: every key of `batch.FIELDS`, of its dtype and shape
    (attention_mask 1 at real tokens, 0 at padding; token_type_ids zeros; masked_* P wide).

    Row for row the same as `mask_sequence`; the work that does not depend on the row's
    generator (int64 conversion, candidates, output arrays) is done once for the batch."""
    if cfg.whole_word_mask and word_starts is None:
        raise ValueError("whole_word_mask needs the word_starts table (ShardDataset.word_starts)")
    src = np.asarray(ids)
    # a copy: becomes input_ids once the masks are written in
    ids64 = src.astype(batch.FIELDS["input_ids"].dtype)
    (B, S), P = ids64.shape, cfg.max_predictions
    cand = _candidates(ids64, cfg)
    first_regular = cfg.first_regular_id  # a dataclass walk: once per batch, not per row
    positions, labels, weights = (batch.zeros(key, B, S, P) for key in
                                  ("masked_positions", "masked_labels", "masked_weights"))
    wids = (_batch_word_ids(ids64, cand, word_starts, cfg.max_word_pieces)
            if cfg.whole_word_mask else None)
    rows, cols, news = [], [], []
    rates = [None] * B if mask_probs is None else np.asarray(mask_probs, np.float64).tolist()
    for r, index in enumerate(np.asarray(indices).tolist()):
        picked = _mask_row(ids64[r], cand[r], index, cfg, word_starts, first_regular,
                           None if wids is None else wids[r], rates[r])
        if picked is None:
            continue
        chosen, new = picked
        m = len(chosen)
        positions[r, :m], labels[r, :m], weights[r, :m] = chosen, ids64[r, chosen], 1.0
        rows.append(np.full(m, r))
        cols.append(chosen)
        news.append(new)
    if rows:  # one scatter for the batch, after every label has been read from the originals
        ids64[np.concatenate(rows), np.concatenate(cols)] = np.concatenate(news)
    attention_mask = (src != cfg.special_ids.pad).astype(batch.FIELDS["attention_mask"].dtype)
    return {
        "input_ids": ids64,
        "attention_mask": attention_mask,
        "token_type_ids": batch.zeros("token_type_ids", B, S, P),
        "masked_positions": positions,
        "masked_labels": labels,
        "masked_weights": weights,
        "unpadded": batch.unpadded_flag(attention_mask),
    }
