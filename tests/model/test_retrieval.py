"""Retrieval math against independent references: identical sides score 1, shuffled pairs
score near chance, mean pooling ignores padding; the default layer is the middle one."""

import pytest
import torch

from megatron_rembert.model.retrieval import (
    accuracy_at_1,
    center,
    chance,
    mean_pool,
    middle_layer,
)


def test_identical_sides_give_accuracy_one():
    emb = torch.randn(50, 16, generator=torch.Generator().manual_seed(0))
    assert accuracy_at_1(emb, emb.clone()) == (1.0, 1.0)


def test_shuffled_pairs_score_near_chance():
    gen = torch.Generator().manual_seed(1)
    n = 400
    src = torch.randn(n, 32, generator=gen)
    tgt = src[torch.randperm(n, generator=gen)]  # right vectors, wrong pairing
    fwd, bwd = accuracy_at_1(src, tgt)
    # A random permutation has on average one fixed point: expect ~1/n, never more than a few.
    assert fwd <= 5 / n and bwd <= 5 / n
    assert chance(n) == 1 / n


def test_accuracy_matches_a_naive_loop_in_both_directions():
    gen = torch.Generator().manual_seed(2)
    src = torch.randn(100, 8, generator=gen)
    tgt = src + 1.2 * torch.randn(100, 8, generator=gen)  # noisy: some pairs are missed
    cos = torch.nn.functional.cosine_similarity

    def naive(a, b):
        return sum(int(cos(a[i:i + 1], b).argmax() == i) for i in range(len(a))) / len(a)

    fwd, bwd = accuracy_at_1(src, tgt)
    assert 0.05 < fwd < 1.0  # the case is neither trivial nor hopeless
    assert abs(fwd - naive(src, tgt)) < 1e-9 and abs(bwd - naive(tgt, src)) < 1e-9


def test_mean_pool_ignores_padding():
    hidden = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    pooled = mean_pool(hidden, mask)
    assert torch.equal(pooled[0], (hidden[0, 0] + hidden[0, 1]) / 2)
    assert torch.equal(pooled[1], hidden[1, 0])


def test_middle_layer_is_central_among_layers_and_among_hidden_states():
    for n in range(1, 40):
        layer = middle_layer(n)
        # central among the Transformer layers 1..n: as many above as below, or one more above
        assert (n - layer) - (layer - 1) in (0, 1), n
        # central among the n + 1 hidden states 0..n (embeddings included): one more below
        # at most
        assert layer - (n - layer) in (0, 1), n
    assert [middle_layer(n) for n in (1, 2, 3, 12, 32)] == [1, 1, 2, 6, 16]
    with pytest.raises(ValueError):
        middle_layer(0)


def test_centering_removes_each_language_s_own_direction():
    """Two languages whose texts share content vectors but each carry a large direction of
    their own: the raw cosine is dominated by that direction (near chance), each side minus
    its mean finds every translation."""
    gen = torch.Generator().manual_seed(3)
    n, h = 200, 32
    content = torch.randn(n, h, generator=gen)
    lang_a = 30 * torch.randn(1, h, generator=gen)
    lang_b = 30 * torch.randn(1, h, generator=gen)
    src, tgt = content + lang_a, content + 0.1 * torch.randn(n, h, generator=gen) + lang_b
    raw = accuracy_at_1(src, tgt)
    assert max(raw) < 0.5
    assert accuracy_at_1(center(src), center(tgt)) == (1.0, 1.0)
    # center is "minus the column means", computed independently
    assert torch.allclose(center(src), src - src.sum(0) / n, atol=1e-4)
