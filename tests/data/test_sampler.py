"""The sample stream: pure in (seed, index), alpha-weighted, epoch-complete per language,
disjoint and complete across data-parallel ranks, exact on resume."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_rembert.data.sampler import MultilingualSampler, language_weights, rank_sample_indices
from megatron_rembert.parallel.layout import Layout


def test_language_weights():
    p = language_weights([100, 400, 0], alpha=0.5)
    np.testing.assert_allclose(p, [1 / 3, 2 / 3, 0.0])
    np.testing.assert_allclose(language_weights([100, 400], 1.0), [0.2, 0.8])


def test_pure_function_of_seed_and_index():
    a = MultilingualSampler([50, 7, 300], [5000, 700, 30000], alpha=0.5, seed=3)
    b = MultilingualSampler([50, 7, 300], [5000, 700, 30000], alpha=0.5, seed=3)
    idx = np.arange(0, 20000)
    la, ra = a(idx)
    rev = idx[::-1].copy()  # a fresh sampler, asked in another order and in pieces
    lb, rb = b(rev[:7000])
    lb2, rb2 = b(rev[7000:])
    np.testing.assert_array_equal(np.concatenate([lb, lb2])[::-1], la)
    np.testing.assert_array_equal(np.concatenate([rb, rb2])[::-1], ra)
    lc, _ = MultilingualSampler([50, 7, 300], [5000, 700, 30000], alpha=0.5, seed=4)(idx)
    assert (lc != la).mean() > 0.1  # another seed, another stream


def test_proportions_and_epochs():
    rows = [50, 7, 300]
    s = MultilingualSampler(rows, [5000, 700, 30000], alpha=0.5, seed=0)
    n = 4 * s.block_size
    lang, row = s(np.arange(n))
    np.testing.assert_allclose(np.bincount(lang, minlength=3) / n, s.probs, atol=1e-3)
    for l, n_rows in enumerate(rows):
        mine = row[lang == l]
        assert mine.max() < n_rows
        full = len(mine) // n_rows
        for e in range(min(full, 5)):  # each epoch visits every row exactly once
            assert sorted(mine[e * n_rows:(e + 1) * n_rows]) == list(range(n_rows))
        assert not np.array_equal(mine[:n_rows], mine[n_rows:2 * n_rows])  # reshuffled


@pytest.mark.parametrize("dp_size, micro", [(1, 4), (2, 2), (4, 1), (4, 2)])
def test_ranks_disjoint_and_complete(dp_size, micro):
    G, steps = 8, 5
    ranks = [Layout.build(dp_size, r, micro_batch_size=micro, global_batch_size=G)
             for r in range(dp_size)]
    seen = []
    for step in range(steps):
        for layout in ranks:
            for j in range(layout.gas):
                seen.append(rank_sample_indices(step, j, layout))
    seen = np.concatenate(seen)
    assert len(seen) == len(set(seen.tolist())) == G * steps
    assert set(seen.tolist()) == set(range(G * steps))
    # rank r's slice of a step is contiguous: the r-th G/dp of the global batch
    r1 = np.concatenate([rank_sample_indices(2, j, ranks[-1]) for j in range(ranks[-1].gas)])
    np.testing.assert_array_equal(r1, np.arange(3 * G - G // dp_size, 3 * G))


def test_micro_step_outside_the_step():
    with pytest.raises(ValueError, match="micro_step 2 not in"):
        rank_sample_indices(0, 2, Layout(dp=2, micro_batch_size=2, gas=2))
