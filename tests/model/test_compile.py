"""model.compile: Transformer layers through torch.compile equal the eager layers on CPU
(inductor's C++ backend), forward and backward, on both attention paths and in bf16."""

import pytest
import torch
from torch._dynamo.utils import counters

from megatron_rembert.config import ConfigError, get_preset
from megatron_rembert.model.rembert import RemBertForPreTraining


def _batch(config, unpadded: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, config.vocab_size, (2, 32), generator=g)
    mask = torch.ones_like(ids)
    if not unpadded:
        mask[1, 20:] = 0  # a padded sequence: attention takes the mask
    positions = torch.stack([torch.randperm(20, generator=g)[:5] for _ in range(2)])
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids),
                masked_positions=positions, masked_labels=ids.gather(1, positions),
                masked_weights=torch.ones(2, 5), unpadded=torch.tensor([int(unpadded)]))


def _run(compile: bool, dtype, unpadded: bool):
    config = get_preset("tiny").replace(compile=compile)
    model = RemBertForPreTraining(config)
    model.init_weights(0)
    model = model.to(dtype)
    counters.clear()
    out = model(**_batch(config, unpadded))
    (out.loss_sum / out.num_tokens).backward()
    assert (counters["stats"]["unique_graphs"] > 0) == compile  # dynamo ran only if asked
    return out.loss_sum.detach().float(), {n: p.grad.float() for n, p in
                                           model.named_parameters()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("unpadded", [True, False], ids=["flash-path", "masked"])
def test_compiled_layers_equal_eager(dtype, rel, unpadded):
    loss, grads = _run(False, dtype, unpadded)
    loss_c, grads_c = _run(True, dtype, unpadded)
    assert loss_c.item() == pytest.approx(loss.item(), rel=rel)
    scale = max(g.abs().max().item() for g in grads.values())
    for name, grad in grads.items():  # the key bias's true gradient is 0: absolute noise
        torch.testing.assert_close(grads_c[name], grad, rtol=rel, atol=rel * scale,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert any(g.abs().max() > 0 for n, g in grads_c.items() if ".layers." in n)


def test_compile_with_dropout_is_refused():
    config = get_preset("tiny").replace(compile=True, hidden_dropout_prob=0.1)
    with pytest.raises(ConfigError, match="model.compile=true needs model.hidden_dropout_prob"):
        config.validate()


@pytest.mark.multiprocess
def test_layers_share_one_graph():
    """All layers reuse one compiled graph (dynamo treats their parameters as inputs): a graph
    per layer would pass dynamo's cache limit (8) and leave the later layers eager."""
    config = get_preset("tiny").replace(num_hidden_layers=10, compile=True)
    model = RemBertForPreTraining(config)
    model.init_weights(0)
    counters.clear()
    for _ in range(2):
        out = model(**_batch(config, unpadded=True))
        (out.loss_sum / out.num_tokens).backward()
    # <= 1: an earlier test of this process may have compiled the graph already
    assert counters["stats"]["unique_graphs"] <= 1
    assert counters["frames"]["total"] == counters["frames"]["ok"]  # no frame fell back
    assert not counters["unimplemented"], list(counters["unimplemented"])  # e.g. the limit
