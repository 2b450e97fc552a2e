"""Dropout streams under TP: shared for replicated activations, per rank for sharded ones."""

import pytest
import torch

from megatron_rembert.parallel import random as tp_random
from megatron_rembert.parallel import state
from megatron_rembert.parallel.layout import Layout
from tests.distributed import run_distributed

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def _draws(rank, world_size):
    state.initialize_model_parallel(Layout.build(world_size, rank, tp=world_size))
    tp_random.seed_all(7)
    shared_before = torch.rand(4)
    with tp_random.tp_rng():
        own = torch.rand(4)
    shared_after = torch.rand(4)
    # The TP stream continues where it stopped, it is not re-seeded on entry.
    with tp_random.tp_rng():
        own_next = torch.rand(4)
    state.destroy_model_parallel()
    return shared_before, own, shared_after, own_next


def test_tp_stream_differs_per_rank_default_stream_shared():
    r0, r1 = run_distributed(_draws, 2)
    assert torch.equal(r0[0], r1[0]) and torch.equal(r0[2], r1[2])
    assert not torch.equal(r0[1], r1[1])
    assert not torch.equal(r0[1], r0[3])
    # Using the TP stream leaves the default stream exactly where it would have been.
    torch.manual_seed(7)
    expected = torch.rand(8)
    assert torch.equal(torch.cat([r0[0], r0[2]]), expected)
