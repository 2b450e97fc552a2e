"""model.compile under tensor parallelism (2 gloo ranks): the compiled layer is one graph with
its all-reduces inside (opaque operators), trains as TP = 1 eager, keeps one all-reduce per
block, and with dropout draws the masks of the eager TP = 2 layer on both streams."""

import pytest
import torch
from torch._dynamo.utils import counters

from megatron_rembert.model.rembert import RemBertForPreTraining
from megatron_rembert.parallel import random as tp_random
from megatron_rembert.parallel import state
from megatron_rembert.parallel.layout import Layout
from megatron_rembert.parallel.mappings import ALL_REDUCE_COUNTS
from tests.distributed import run_distributed
from tests.model.helpers import random_batch, small_config
from tests.parallel.test_tensor_parallel import SEED, train_step

pytestmark = pytest.mark.multiprocess  # every test spawns processes

DROPOUT = dict(hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.2)


def _dropout_steps(config, batch) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    """Two training forwards and backwards with dropout: losses, and where the default and
    this rank's TP stream stand afterwards."""
    model = RemBertForPreTraining(config)
    model.init_weights(SEED)
    tp_random.seed_all(3)
    losses = []
    for _ in range(2):
        out = model(**batch)
        out.loss_sum.backward()
        losses.append(out.loss_sum.item())
    return losses, torch.get_rng_state(), tp_random._tp_states["cpu"].clone()


def _worker(rank, world_size, config, batch):
    state.initialize_model_parallel(Layout.build(world_size, rank, tp=world_size))
    try:
        torch._dynamo.reset()
        counters.clear()
        compiled = train_step(config.replace(compile=True), batch)
        graphs = counters["stats"]["unique_graphs"]
        breaks = dict(counters["graph_break"])

        model = RemBertForPreTraining(config.replace(compile=True))
        model.init_weights(SEED)
        layer = model.rembert.layers[0]
        x = torch.randn(2, 7, config.hidden_size, requires_grad=True)
        explained = torch._dynamo.explain(layer._layer)(x, torch.ones(2, 7, dtype=torch.bool))
        ALL_REDUCE_COUNTS.clear()
        y = layer(x, None)
        forward = dict(ALL_REDUCE_COUNTS)
        ALL_REDUCE_COUNTS.clear()
        y.sum().backward()
        backward = dict(ALL_REDUCE_COUNTS)

        dropped = config.replace(**DROPOUT)
        eager_dropout = _dropout_steps(dropped.replace(compile=False), batch)
        compiled_dropout = _dropout_steps(dropped.replace(compile=True), batch)
    finally:
        state.destroy_model_parallel()
    return dict(compiled=compiled, graphs=graphs, breaks=breaks,
                explained=(explained.graph_count, explained.graph_break_count),
                forward=forward, backward=backward, eager_dropout=eager_dropout,
                compiled_dropout=compiled_dropout)


@pytest.fixture(scope="module")
def tp2_runs():
    config = small_config(loss_backend="reference")
    batch = random_batch(config)
    return train_step(config.replace(compile=False), batch), run_distributed(
        _worker, 2, config, batch, timeout=900)


def test_compiled_tp2_trains_as_eager_tp1(tp2_runs):
    (loss, correct, weights, grads), ranks = tp2_runs
    tp_loss, tp_correct, tp_weights, tp_grads = ranks[0]["compiled"]
    assert abs(loss - tp_loss) <= 1e-5 * max(1.0, abs(loss))
    assert correct == tp_correct
    for name in grads:
        assert torch.equal(weights[name], tp_weights[name]), name
        torch.testing.assert_close(tp_grads[name], grads[name], atol=1e-5, rtol=1e-5,
                                   msg=f"gradient of {name}")


def test_one_graph_with_the_all_reduces_inside(tp2_runs):
    """3 layers, one batch (padded: one attention path): one graph, no break; dynamo's
    explain agrees; one all-reduce per block in forward and in backward, as eager."""
    _, ranks = tp2_runs
    for run in ranks:
        assert run["graphs"] == 1 and not run["breaks"], run["breaks"]
        assert run["explained"] == (1, 0)
        assert run["forward"] == {"forward": 2} and run["backward"] == {"backward": 2}


def test_compiled_tp2_dropout_draws_eager_masks(tp2_runs):
    _, ranks = tp2_runs
    for run in ranks:
        (losses, *streams), (losses_c, *streams_c) = run["eager_dropout"], run["compiled_dropout"]
        assert losses_c == pytest.approx(losses, rel=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(streams_c, streams, strict=True))
    # TP peers share the default stream and keep their own TP streams
    (_, default_0, tp_0), (_, default_1, tp_1) = (r["compiled_dropout"] for r in ranks)
    assert torch.equal(default_0, default_1) and not torch.equal(tp_0, tp_1)
