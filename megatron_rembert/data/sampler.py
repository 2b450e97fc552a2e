"""The multilingual sample stream: global sample index -> (language, row).

Language weights are p_l = n_l^alpha / sum_k n_k^alpha (n_l = training tokens of language l;
alpha = 0.5 in Chung et al. 2020, after XLM-R/mBERT's exponential smoothing).

The stream is a pure function of (seed, index), so any rank can compute any part of it and a
resume at `consumed_samples` continues exactly. It is built from blocks of B samples:
- block b holds exactly A_l(b+1) - A_l(b) samples of language l, where
  A_l(b) = floor(b*B*c_l) - floor(b*B*c_{l-1}) is the number of language-l samples before block
  b and c_l = p_1 + ... + p_l (so the long-run share of l is exactly p_l; B >= 1/min p_l keeps
  every quota non-negative), in an order shuffled by rng(seed, 0, b);
- the k-th language-l sample (k counted over the whole stream) is row perm_e(k mod n_rows_l)
  with e = k div n_rows_l and perm_e a pseudo-random permutation of [0, n_rows_l) keyed by
  rng(seed, 1, l, e): every epoch of a language visits each of its rows exactly once before any
  row repeats. perm_e is a 4-round Feistel network on the smallest even number of bits covering
  n_rows_l, with cycle-walking (Black & Rogaway 2002), so it costs O(1) per sample and no
  memory, however many rows a language has.
rng(*words) = np.random.Generator(np.random.Philox(np.random.SeedSequence([*words]))).

Under a schedule (`data/schedule.py`) the stream is cut into segments of constant language
weights (at phase starts and language entry points, at sample index first_step x G for a
global batch of G). Segment j (j > 0) is a stream of its own as above with its weights and
block order rng(seed, 0, b, j), and picks continue each language's count k where the earlier
segments left it, so epochs still visit every row once across segment boundaries. A run without
a schedule is one segment: the stream above, unchanged.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from megatron_rembert.data.common import DataError
from megatron_rembert.parallel.layout import Layout


def rng_for(*words: int) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(np.random.SeedSequence(list(words))))


def language_weights(tokens: list[int], alpha: float) -> np.ndarray:
    """[L] float64, p_l = n_l^alpha / sum_k n_k^alpha (alpha=1: proportional, alpha=0:
    uniform), sums to 1; a language with n_l = 0 gets weight 0. The one definition, for the
    sampler, the tokenizer's training sample and the dataset summary."""
    t = np.asarray(tokens, dtype=np.float64)
    if (t <= 0).all():
        raise DataError("no language has any training tokens; check the dataset's manifest.")
    w = np.where(t > 0, t ** alpha, 0.0)
    return w / w.sum()


class _LRU(OrderedDict):
    size = 4

    def __init__(self, size: int = 4):
        super().__init__()
        self.size = size

    def put(self, key, value):
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)
        return value


class MultilingualSampler:
    """Maps global sample indices to (language index, row index); see the module docstring."""

    def __init__(self, rows_per_language: list[int], tokens_per_language: list[int],
                 alpha: float = 0.5, seed: int = 0, block_size: int | None = None,
                 active: list[bool] | None = None, segment: int = 0):
        self.rows = np.asarray(rows_per_language, dtype=np.int64)
        self.probs = language_weights(tokens_per_language, alpha)
        self.probs[self.rows == 0] = 0.0
        if active is not None:  # languages not yet entered (schedule) get weight 0
            self.probs[~np.asarray(active, dtype=bool)] = 0.0
        if not self.probs.sum() > 0:
            raise DataError("no language to sample from: every language with training rows "
                            "enters later (data.language_start)")
        self.probs /= self.probs.sum()
        self.seed, self.segment = int(seed), int(segment)
        min_p = self.probs[self.probs > 0].min()
        # B * p_l >= 1 for every sampled language keeps per-block quotas non-negative.
        need = max(4096, math.ceil(2.0 / min_p))
        self.block_size = block_size or 1 << (need - 1).bit_length()
        if self.block_size * min_p < 1:
            raise ValueError(f"block_size {self.block_size} < 1/min p_l = {1 / min_p:.0f}")
        self.cum = np.cumsum(self.probs)
        self.cum[-1] = 1.0  # exact, so the counts of all languages add up to b*B
        self._blocks, self._key_cache = _LRU(4), _LRU(2 * len(self.rows) + 2)

    def __getstate__(self) -> dict:
        # caches are rebuilt in each worker process rather than pickled
        state = dict(self.__dict__)
        state["_blocks"], state["_key_cache"] = _LRU(4), _LRU(2 * len(self.rows) + 2)
        return state

    def counts_before(self, block: int) -> np.ndarray:
        """[L] int64: samples of each language in blocks [0, block)."""
        a = np.floor(block * self.block_size * self.cum).astype(np.int64)
        return np.diff(a, prepend=0)

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Language of each position of block b, and its global pick number k."""
        if b in self._blocks:
            return self._blocks[b]
        start = self.counts_before(b)
        quota = self.counts_before(b + 1) - start  # [L], sums to B
        assert (quota >= 0).all(), "block quotas must be non-negative"
        words = (self.seed, 0, b) if self.segment == 0 else (self.seed, 0, b, self.segment)
        langs = rng_for(*words).permutation(np.repeat(np.arange(len(quota)), quota))
        order = np.argsort(langs, kind="stable")
        rank = np.empty(self.block_size, dtype=np.int64)
        rank[order] = np.arange(self.block_size) - np.repeat(np.cumsum(quota) - quota, quota)
        return self._blocks.put(b, (langs, start[langs] + rank))

    def _keys(self, lang: int, epoch: int) -> np.ndarray:
        key = (lang, epoch)
        if key in self._key_cache:
            return self._key_cache[key]
        keys = rng_for(self.seed, 1, lang, epoch).integers(0, 2**63, size=4, dtype=np.uint64)
        return self._key_cache.put(key, keys)

    def counts_upto(self, n: int) -> np.ndarray:
        """[L] int64: samples of each language among indices [0, n)."""
        b, r = divmod(n, self.block_size)
        return self.counts_before(b) + np.bincount(self._block(b)[0][:r],
                                                   minlength=len(self.rows))

    def __call__(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """indices [N] int64 -> (language index [N], row within language [N])."""
        lang, pick = self.languages_and_picks(indices)
        return lang, self.rows_of(lang, pick)

    def languages_and_picks(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """indices [N] -> (language [N], k [N]: the sample is the k-th of its language)."""
        indices = np.asarray(indices, dtype=np.int64)
        if (indices < 0).any():
            raise ValueError("sample indices must be non-negative")
        lang = np.empty(len(indices), dtype=np.int64)
        pick = np.empty(len(indices), dtype=np.int64)
        blocks = indices // self.block_size
        for b in np.unique(blocks).tolist():
            sel = blocks == b
            langs, picks = self._block(b)
            lang[sel] = langs[indices[sel] % self.block_size]
            pick[sel] = picks[indices[sel] % self.block_size]
        return lang, pick

    def rows_of(self, lang: np.ndarray, pick: np.ndarray) -> np.ndarray:
        """The row of the pick-th sample of each language: perm_e(pick mod n_rows)."""
        n_rows = self.rows[lang]
        epoch, pos = pick // n_rows, pick % n_rows
        # One vectorised Feistel pass over all samples, each with its own (lang, epoch) keys
        # and width, rather than one pass per (lang, epoch) group: a micro-batch touches most
        # languages, and each pass is a dozen numpy calls on a handful of elements.
        keys = np.empty((len(lang), 4), dtype=np.uint64)
        for l, e in set(zip(lang.tolist(), epoch.tolist(), strict=True)):
            keys[(lang == l) & (epoch == e)] = self._keys(l, e)
        return _feistel(pos, n_rows, keys)


class ScheduledSampler:
    """The sample stream under a schedule: one `MultilingualSampler` per segment of constant
    language weights (see the module docstring). `segments`: (first sample index, alpha,
    active languages), the first at index 0."""

    def __init__(self, rows_per_language: list[int], tokens_per_language: list[int],
                 segments: list[tuple[int, float, list[bool] | None]], seed: int = 0):
        if not segments or segments[0][0] != 0:
            raise ValueError("the first segment must start at sample 0")
        self.starts = np.array([s[0] for s in segments], dtype=np.int64)
        self.parts = [MultilingualSampler(rows_per_language, tokens_per_language, alpha, seed,
                                          active=active, segment=j)
                      for j, (_, alpha, active) in enumerate(segments)]
        # picks of each language before each segment: the counts of all earlier segments
        self.offsets = [np.zeros(len(rows_per_language), dtype=np.int64)]
        for j in range(1, len(self.parts)):
            length = int(self.starts[j] - self.starts[j - 1])
            self.offsets.append(self.offsets[-1] + self.parts[j - 1].counts_upto(length))

    @property
    def probs(self) -> np.ndarray:
        return self.parts[0].probs

    def __call__(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """indices [N] int64 -> (language index [N], row within language [N])."""
        indices = np.asarray(indices, dtype=np.int64)
        seg = np.searchsorted(self.starts, indices, side="right") - 1
        lang = np.empty(len(indices), dtype=np.int64)
        pick = np.empty(len(indices), dtype=np.int64)
        for j in np.unique(seg).tolist():
            sel = seg == j
            lang[sel], pick[sel] = self.parts[j].languages_and_picks(indices[sel] - self.starts[j])
            pick[sel] += self.offsets[j][lang[sel]]
        return lang, self.parts[0].rows_of(lang, pick)


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-mixing function uint64 -> uint64."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def feistel_permute(x: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """A keyed bijection of [0, n), applied elementwise to x [N] (values in [0, n))."""
    x = np.asarray(x)
    return _feistel(x, np.full(len(x), n, dtype=np.int64),
                    np.broadcast_to(np.asarray(keys, dtype=np.uint64), (len(x), len(keys))))


def _feistel(x: np.ndarray, n: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """`feistel_permute` with a domain size n [N] and round keys [N, R] per element."""
    n = np.asarray(n, dtype=np.int64)
    # half = max(1, (bit_length(max(n - 1, 1)) + 1) // 2), elementwise; frexp's exponent of a
    # positive integer below 2^53 is exactly its bit length
    bits = np.frexp(np.maximum(n - 1, 1).astype(np.float64))[1].astype(np.uint64)
    half = np.maximum((bits + np.uint64(1)) // np.uint64(2), np.uint64(1))
    mask = (np.uint64(1) << half) - np.uint64(1)
    limit = n.astype(np.uint64)
    out = np.asarray(x, dtype=np.uint64).copy()
    todo = np.ones(len(out), dtype=bool)
    with np.errstate(over="ignore"):
        while todo.any():  # cycle-walking: re-apply until the value lands inside [0, n)
            v, h, m = out[todo], half[todo], mask[todo]
            left, right = v >> h, v & m
            for k in keys[todo].T:
                left, right = right, left ^ (_mix(right ^ k) & m)
            v = (left << h) | right
            out[todo] = v
            todo[todo] = v >= limit[todo]
    return out.astype(np.int64)


def rank_sample_indices(step: int, micro_step: int, layout: Layout) -> np.ndarray:
    """Global indices of micro-batch `micro_step` of this rank (`layout.dp_rank`) at `step`.

    The global batch G of step k is samples [k*G, (k+1)*G); DP rank r owns the contiguous
    slice [k*G + r*G/dp, k*G + (r+1)*G/dp), cut into `layout.gas` micro-batches."""
    if not 0 <= micro_step < layout.gas:
        raise ValueError(f"micro_step {micro_step} not in [0, {layout.gas})")
    g, m = layout.global_batch_size, layout.micro_batch_size
    start = step * g + layout.dp_rank * (g // layout.dp) + micro_step * m
    return np.arange(start, start + m, dtype=np.int64)
