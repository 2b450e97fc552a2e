"""Micro-batches without padding run attention with no mask (FlashAttention on CUDA)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_rembert.data.batch import check_micro_batch, unpadded_flag
from megatron_rembert.model.pipeline import (
    pipeline_inputs,
    pipeline_layer_builders,
    set_unpadded,
)
from megatron_rembert.model.rembert import RemBertForPreTraining
from megatron_rembert.parallel.layers import init_weights
from tests.model.helpers import random_batch, small_config


def _full_batch(config, **kw):
    """random_batch without its padding, flagged unpadded."""
    batch = random_batch(config, **kw)
    batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
    batch["unpadded"] = torch.from_numpy(unpadded_flag(batch["attention_mask"].numpy()))
    return batch


def test_flag_from_the_attention_mask():
    config = small_config()
    padded = random_batch(config)
    assert unpadded_flag(padded["attention_mask"].numpy()).tolist() == [0]
    assert unpadded_flag(np.ones((2, 8), np.int64)).tolist() == [1]
    check_micro_batch(_full_batch(config))
    lying = {**padded, "unpadded": torch.ones(1, dtype=torch.long)}
    with pytest.raises(ValueError, match="unpadded is 1 but attention_mask has padding"):
        check_micro_batch(lying)


def _loss_and_grads(model, batch):
    model.zero_grad()
    out = model(**batch)
    out.loss_sum.backward()
    return out.loss_sum.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["sdpa", "fused_softmax"])
# Measured on CPU over 5 seeds: no difference at all in either dtype (torch's CPU SDPA and our
# softmax reference treat an all-True mask exactly as none); bf16 keeps the usual 5e-3 margin
# for kernels that order their sums differently.
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 5e-3)])
def test_no_mask_path_equals_the_masked_one(backend, dtype, tolerance, monkeypatch):
    config = small_config(attention_backend=backend)
    torch.manual_seed(0)
    model = RemBertForPreTraining(config)
    model.init_weights(seed=1)
    model.to(dtype)
    batch = _full_batch(config)
    masks = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, attn_mask=None, **kw: masks.append(attn_mask) or sdpa(
                            *a, attn_mask=attn_mask, **kw))
    fast = _loss_and_grads(model, batch)
    masked = _loss_and_grads(model, {**batch, "unpadded": torch.zeros(1, dtype=torch.long)})
    if backend == "sdpa":  # the first pass called SDPA without a mask, the second with one
        layers = config.num_hidden_layers
        assert masks[:layers] == [None] * layers
        assert all(m is not None for m in masks[layers:])
    scale = max(1.0, masked[0].abs().item())
    assert (fast[0] - masked[0]).abs().item() <= tolerance * scale
    for name, grad in masked[1].items():
        diff = (fast[1][name].float() - grad.float()).abs().max().item()
        assert diff <= tolerance * max(1.0, grad.float().abs().max().item()), name


def test_pipeline_layers_take_the_path_they_are_told():
    """Run the pipeline layers in one process: `set_unpadded` reaches every Transformer layer
    (a padded batch run unpadded attends to its padding), and the flag is not an input."""
    config = small_config()
    layers = [cls(*args) for cls, args in pipeline_layer_builders(config)]
    for layer in layers:
        init_weights(layer, 1, config.initializer_range, prefix=layer.pipe_prefix)

    def run(batch, unpadded):  # -> the last Transformer layer's output and the loss
        set_unpadded(layers, unpadded)
        x = pipeline_inputs(batch)
        for layer in layers[:-1]:
            x = layer(x)
        return x[0], layers[-1](x).loss_sum

    full = _full_batch(config)
    hidden, loss = run(full, True)
    masked_hidden, masked_loss = run(full, False)
    assert (hidden - masked_hidden).abs().max() <= 1e-6 and loss == masked_loss
    padded = random_batch(config)
    assert (run(padded, True)[0] - run(padded, False)[0]).abs().max() > 1e-3
