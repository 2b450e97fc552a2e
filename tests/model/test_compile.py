"""model.compile: Transformer layers through torch.compile equal the eager layers on CPU
(inductor's C++ backend), forward and backward, on both attention paths, in bf16, with dropout
(the same masks as eager, on both RNG streams) and under activation checkpointing; all layers
share one graph per attention path, without a graph break or a recompile."""

import pytest
import torch
from torch._dynamo.utils import counters

from megatron_rembert.config import ConfigError, get_preset
from megatron_rembert.model.rembert import RemBertForPreTraining
from megatron_rembert.parallel import random as tp_random
from megatron_rembert.run_config.load import load_config

DROPOUT = dict(hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.2)


def _batch(config, unpadded: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, config.vocab_size, (2, 32), generator=g)
    mask = torch.ones_like(ids)
    if not unpadded:
        mask[1, 20:] = 0  # a padded sequence: attention takes the mask
    positions = torch.stack([torch.randperm(20, generator=g)[:5] for _ in range(2)])
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids),
                masked_positions=positions, masked_labels=ids.gather(1, positions),
                masked_weights=torch.ones(2, 5), unpadded=torch.tensor([int(unpadded)]))


def _model(config, dtype=torch.float32) -> RemBertForPreTraining:
    model = RemBertForPreTraining(config)
    model.init_weights(0)
    return model.to(dtype)


def _steps(model, paths=(False, True)) -> tuple[list[float], dict]:
    """Forward and backward of one batch per attention path (False: masked, True: unpadded);
    the losses and the summed gradients."""
    losses = []
    for i, unpadded in enumerate(paths):
        out = model(**_batch(model.config, unpadded, seed=i))
        (out.loss_sum / out.num_tokens).backward()
        losses.append(out.loss_sum.item())
    return losses, {n: p.grad.float() for n, p in model.named_parameters()}


def _assert_grads_close(grads_c: dict, grads: dict, rel: float) -> None:
    scale = max(g.abs().max().item() for g in grads.values())
    for name, grad in grads.items():  # the key bias's true gradient is 0: absolute noise
        torch.testing.assert_close(grads_c[name], grad, rtol=rel, atol=rel * scale,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert any(g.abs().max() > 0 for n, g in grads_c.items() if ".layers." in n)


def _streams() -> tuple[torch.Tensor, torch.Tensor]:
    """Where the default and the TP dropout streams stand."""
    return torch.get_rng_state(), tp_random._tp_states["cpu"].clone()


@pytest.mark.multiprocess  # inductor compiles in worker processes
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("unpadded", [True, False], ids=["flash-path", "masked"])
def test_compiled_layers_equal_eager(dtype, rel, unpadded):
    torch._dynamo.reset()
    loss, grads = _steps(_model(get_preset("tiny").replace(compile=False), dtype), [unpadded])
    counters.clear()
    loss_c, grads_c = _steps(_model(get_preset("tiny").replace(compile=True), dtype), [unpadded])
    assert counters["stats"]["unique_graphs"] == 1  # dynamo compiled the layer
    assert loss_c == pytest.approx(loss, rel=rel)
    _assert_grads_close(grads_c, grads, rel)


@pytest.mark.multiprocess  # inductor compiles in worker processes
@pytest.mark.parametrize("backend", ["sdpa", "fused_softmax"])
def test_compiled_dropout_draws_eager_masks(backend):
    """Hidden dropout (default stream) and attention dropout (this rank's TP stream) under
    compile draw eager's masks: losses and gradients agree, and both streams end where eager
    leaves them. Compiled without fallback_random (inductor's own random numbers) the losses
    differed by ~2e-4 relative, 20x the tolerance."""
    config = get_preset("tiny").replace(attention_backend=backend, **DROPOUT)
    runs = {}
    for compiled in (False, True):
        tp_random.seed_all(3)
        runs[compiled] = (*_steps(_model(config.replace(compile=compiled))), _streams())
    (losses, grads, streams), (losses_c, grads_c, streams_c) = runs[False], runs[True]
    assert losses_c == pytest.approx(losses, rel=1e-5)
    _assert_grads_close(grads_c, grads, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(streams_c, streams, strict=True))
    tp_random.seed_all(3)
    undropped, _ = _steps(_model(config.replace(hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0)))
    assert losses != pytest.approx(undropped, rel=1e-3)  # the dropout did drop


@pytest.mark.multiprocess  # inductor compiles in worker processes
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_activation_checkpointing_replays_dropout(compiled):
    """Each layer recomputed in backward (torch's non-reentrant checkpoint, around the compiled
    layer when compiled) trains as the plain eager model, with dropout on both streams: the
    recomputation redraws the forward's masks, and afterwards both streams stand where the
    plain model leaves them (torch's early stop of a recomputation used to leave the TP
    stream rewound, so the next step repeated a layer's attention masks)."""
    config = get_preset("tiny").replace(num_hidden_layers=3, **DROPOUT)
    runs = {}
    torch._dynamo.reset()
    counters.clear()
    for checkpointing in (False, True):
        model = _model(config.replace(compile=compiled and checkpointing))
        model.rembert.activation_checkpointing = checkpointing
        tp_random.seed_all(3)
        runs[checkpointing] = (*_steps(model, (False, True, False)), _streams())
    assert (counters["stats"]["unique_graphs"] == 2) == compiled
    (losses, grads, streams), (losses_c, grads_c, streams_c) = runs[False], runs[True]
    assert losses_c == pytest.approx(losses, rel=1e-5)
    _assert_grads_close(grads_c, grads, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(streams_c, streams, strict=True))


@pytest.mark.multiprocess  # inductor compiles in worker processes
def test_layers_share_one_graph_per_attention_path():
    """All layers reuse one compiled graph per attention path (dynamo treats their parameters
    as inputs): a graph per layer would pass dynamo's recompile limit (8) and leave the later
    layers eager. The padded and unpadded paths alternating compile two graphs, then none;
    no graph break, no frame left to eager."""
    torch._dynamo.reset()
    counters.clear()
    model = _model(get_preset("tiny").replace(num_hidden_layers=10, compile=True, **DROPOUT))
    _steps(model, (True, False))
    assert counters["stats"]["unique_graphs"] == 2
    _steps(model, (True, False, True, False))
    assert counters["stats"]["unique_graphs"] == 2  # no recompile
    assert counters["frames"]["total"] == counters["frames"]["ok"]  # no frame fell back
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not counters["unimplemented"], list(counters["unimplemented"])  # e.g. the limit


@pytest.mark.multiprocess  # inductor compiles in worker processes
def test_one_graph_without_break():
    """dynamo's own account of one layer: one graph, no break, on both attention paths."""
    model = _model(get_preset("tiny").replace(**DROPOUT))
    layer = model.rembert.layers[0]
    x = torch.randn(2, 8, model.config.hidden_size, requires_grad=True)
    for key_mask in (None, torch.ones(2, 8, dtype=torch.bool)):
        explained = torch._dynamo.explain(layer._layer)(x, key_mask)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
            explained.break_reasons


def test_auto_compiles_on_cuda_only():
    config = get_preset("rembert")
    assert config.compile == "auto"
    assert config.compiles_on("cuda") and not config.compiles_on("cpu")
    assert config.replace(compile=True).compiles_on("cpu")
    assert not config.replace(compile=False).compiles_on("cuda")
    torch._dynamo.reset()
    counters.clear()
    _steps(_model(get_preset("tiny")), (True,))  # auto on the CPU: eager
    assert counters["stats"]["unique_graphs"] == 0


@pytest.mark.parametrize("text, value", [("auto", "auto"), ("true", True), ("false", False)])
def test_compile_setting_parses(text, value):
    assert load_config(None, [f"model.compile={text}"]).model.compile == value


@pytest.mark.parametrize("text", ["always", "1"])
def test_bad_compile_setting_is_refused(text):
    with pytest.raises(ConfigError, match="model.compile"):
        load_config(None, [f"model.compile={text}"]).model.validate()
