"""TP = 2 and TP = 3 against TP = 1: same initial weights, loss and gathered gradients."""

import pytest
import torch
import torch.distributed as dist

from megatron_rembert.model.rembert import RemBertForPreTraining
from megatron_rembert.model.transformer import TransformerLayer
from megatron_rembert.parallel import state
from megatron_rembert.parallel.layout import Layout
from megatron_rembert.parallel.mappings import ALL_REDUCE_COUNTS
from tests.distributed import run_distributed
from tests.model.helpers import random_batch, small_config

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SEED = 1234


def gather_full(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor from this rank's shard (vocabulary padding rows dropped)."""
    split = getattr(param, "tp_split_dim", None)
    if split is not None and state.tp_size() > 1:
        parts = [torch.empty_like(tensor) for _ in range(state.tp_size())]
        dist.all_gather(parts, tensor.contiguous(), group=state.tp_group())
        tensor = torch.cat(parts, dim=split)
    rows = getattr(param, "vocab_rows", None)
    return tensor[:rows] if rows is not None else tensor


def train_step(config, batch):
    """One forward/backward; returns loss, accuracy count, full weights and gradients."""
    model = RemBertForPreTraining(config)
    model.init_weights(SEED)
    weights = {n: gather_full(p, p.detach()) for n, p in model.named_parameters()}
    out = model(**batch)
    loss = out.loss_sum / out.num_tokens
    loss.backward()
    grads = {n: gather_full(p, p.grad) for n, p in model.named_parameters()}
    return loss.item(), out.num_correct.item(), weights, grads


def _tp_worker(rank, world_size, config, batch):
    state.initialize_model_parallel(Layout.build(world_size, rank, tp=world_size))
    try:
        result = train_step(config, batch)
    finally:
        state.destroy_model_parallel()
    return result if rank == 0 else None


@pytest.mark.parametrize("tp, changes", [
    (2, dict(loss_backend="reference")),
    (3, dict(loss_backend="reference")),
    (2, dict(loss_backend="fused")),
    (3, dict(loss_backend="fused")),
    # Coupled baseline: the decoder reuses the vocab-parallel input table.
    (2, dict(loss_backend="fused", output_embedding_size=16, tie_embeddings=True)),
])
def test_tp_matches_single_process(tp, changes):
    config = small_config(**changes)
    batch = random_batch(config)
    loss, correct, weights, grads = train_step(config, batch)
    tp_loss, tp_correct, tp_weights, tp_grads = run_distributed(_tp_worker, tp, config, batch)[0]

    assert weights.keys() == tp_weights.keys()
    for name in weights:  # initialisation does not depend on the layout
        assert torch.equal(weights[name], tp_weights[name]), name
    assert abs(loss - tp_loss) <= 1e-5 * max(1.0, abs(loss))
    assert correct == tp_correct
    for name in grads:
        torch.testing.assert_close(tp_grads[name], grads[name], atol=1e-5, rtol=1e-5,
                                   msg=f"gradient of {name}")


def _count_worker(rank, world_size, config):
    state.initialize_model_parallel(Layout.build(world_size, rank, tp=world_size))
    layer = TransformerLayer(config)
    x = torch.randn(2, 7, config.hidden_size, requires_grad=True)
    mask = torch.ones(2, 7, dtype=torch.bool)
    ALL_REDUCE_COUNTS.clear()
    y = layer(x, mask)
    forward = dict(ALL_REDUCE_COUNTS)
    ALL_REDUCE_COUNTS.clear()
    y.sum().backward()
    backward = dict(ALL_REDUCE_COUNTS)

    model = RemBertForPreTraining(config)
    batch = random_batch(config)
    ALL_REDUCE_COUNTS.clear()
    model(**batch).loss_sum.backward()
    whole = dict(ALL_REDUCE_COUNTS)
    state.destroy_model_parallel()
    return forward, backward, whole


def test_one_all_reduce_per_block():
    config = small_config(loss_backend="reference")
    forward, backward, whole = run_distributed(_count_worker, 2, config)[0]
    # One after the attention output projection, one after the FFN output projection.
    assert forward == {"forward": 2}
    # Mirrored in backward: the input gradient of each block's column-parallel layers.
    assert backward == {"backward": 2}
    layers = config.num_hidden_layers
    # Model: + the vocab-parallel embedding (forward), the MLM head's input (backward) and the
    # loss's two statistics reductions (one MAX, one SUM).
    assert whole == {"forward": 2 * layers + 1, "backward": 2 * layers + 1, "loss": 2}


def _groups_worker(rank, world_size, tp, pp):
    s = state.initialize_model_parallel(Layout.build(world_size, rank, tp=tp, pp=pp))
    sums = {}
    for name, group in (("tp", s.tp_group), ("dp", s.dp_group), ("pp", s.pp_group),
                        ("model", s.model_group)):
        t = torch.tensor([rank])
        dist.all_reduce(t, group=group)
        sums[name] = t.item()
    state.destroy_model_parallel()
    return (s.pp_rank, s.dp_rank, s.tp_rank), sums


def test_groups_follow_deepspeed_topology():
    topology = pytest.importorskip("deepspeed.runtime.pipe.topology")
    tp, pp, dp = 2, 2, 2
    topo = topology.PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    results = run_distributed(_groups_worker, 8, tp, pp)
    for rank, (coords, sums) in enumerate(results):
        c = topo.get_coord(rank)
        assert coords == (c.pipe, c.data, c.model)
        expected = {
            "tp": sum(topo.filter_match(pipe=c.pipe, data=c.data)),
            "dp": sum(topo.filter_match(pipe=c.pipe, model=c.model)),
            "pp": sum(topo.filter_match(data=c.data, model=c.model)),
            "model": sum(topo.filter_match(data=c.data)),
        }
        assert sums == expected, f"rank {rank}"
