"""No host sync inside a micro-batch: from the first forward to the last backward of a step,
nothing reads a device value on the host or makes a shape that depends on data (each would stall
a GPU until it drains). Checked on CPU with `forbid_host_syncs` (tests/host_sync.py), a
TorchDispatchMode that fails on `_local_scalar_dense` (`.item()`, `bool(t)`), `nonzero`,
`masked_select`, boolean indexing and every op tagged with a data-dependent output:
- the trainer's real micro-batches (training.engine.Trainer at pp = 1, bf16 with
  bf16: DeepSpeed's forward, backward and its bookkeeping between
  micro-batches, our fp32 main gradients), on the flash and the masked attention path, with and
  without activation checkpointing, at TP = 1 and TP = 2;
- each pipeline stage's layers, forward and backward, in bf16, on both paths.
The optimizer step after the last backward may read the gradient norm once (it does).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rembert.model.pipeline import (
    pipeline_inputs,
    pipeline_layer_builders,
    set_unpadded,
)
from megatron_rembert.parallel.grad_buffer import GradBuffer
from megatron_rembert.parallel.layers import init_weights
from tests.distributed import run_distributed
from tests.host_sync import forbid_host_syncs
from tests.model.helpers import random_batch, small_config
from tests.training.helpers import micro_batches

ROOT = Path(__file__).resolve().parents[2]


def _trainer_worker(rank, world_size, unpadded: bool, backend: str, recompute: bool):
    import deepspeed

    from megatron_rembert.parallel import state
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.plan import RunPlan

    deepspeed.init_distributed(dist_backend="gloo")
    config = build_config({"model": {"preset": "tiny"}}, [
        f"parallel.tp={world_size}", "train.precision=bf16",
        f"parallel.activation_checkpointing={str(recompute).lower()}",
        f"model.attention_backend={backend}", "train.global_batch_size=4",
        "train.micro_batch_size=2", "data.seq_length=16", "optim.warmup_steps=1"])
    plan = RunPlan.build(config, world_size, rank)
    state.initialize_model_parallel(plan.layout)
    trainer = Trainer(config, plan, torch.device("cpu"))
    checked = 0
    for step in range(2):
        batches = micro_batches(step, 4, 2, 0, 1, config.model.vocab_size)
        for mb in batches:  # the flag the loader would set for these rows
            mb["unpadded"] = torch.tensor([int(unpadded)])
            if unpadded:
                mb["attention_mask"] = torch.ones_like(mb["attention_mask"])
        prepared, context = trainer._prepare(batches)
        trainer.optimizer.start_weight_gather()  # as train_step: in flight during the forward
        with forbid_host_syncs():
            trainer.forward_backward(prepared, context)
        trainer.engine.step()  # DeepSpeed's boundary step: our optimizer's
        checked += len(prepared)
    return checked


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("unpadded,backend,recompute", [
    (True, "sdpa", False), (False, "sdpa", True), (False, "fused_softmax", False)],
    ids=["flash", "masked-recompute", "masked-fused-softmax"])
def test_trainer_micro_batches_never_sync(tp, unpadded, backend, recompute):
    assert run_distributed(_trainer_worker, tp, unpadded, backend, recompute) == [4] * tp


@pytest.mark.parametrize("unpadded", [True, False], ids=["flash", "masked"])
def test_every_pipeline_stage_never_syncs(unpadded):
    """Two stages (embedding + a layer | two layers + head), as a pipeline runs them: each
    stage's forward, then backward from the received gradient, under the mode, in bf16, with
    the trainer's fp32 main gradients on every parameter."""
    config = small_config()
    layers = [cls(*args) for cls, args in pipeline_layer_builders(config)]
    for layer in layers:
        init_weights(layer, 1, config.initializer_range, prefix=layer.pipe_prefix)
        layer.to(torch.bfloat16)
    # fp32 main gradients, as the trainer's (one process: nothing to reduce); the hooks act
    # while the buffer lives
    buffer = GradBuffer([p for layer in layers for p in layer.parameters()], dp_group=None)
    set_unpadded(layers, unpadded)
    batch = random_batch(config)
    if unpadded:
        batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
    stages = [layers[:2], layers[2:]]
    with forbid_host_syncs():
        first = pipeline_inputs(batch)
        for layer in stages[0]:
            first = layer(first)
        received = (first[0].detach().requires_grad_(), *first[1:])
        x = received
        for layer in stages[1][:-1]:
            x = layer(x)
        out = stages[1][-1](x)
        out.loss_sum.backward()  # the last stage: backward from its loss
        first[0].backward(received[0].grad)  # the first stage: from the gradient it received
    for layer in layers:
        for name, param in layer.named_parameters():
            assert param.grad is None, name  # every gradient went into main_grad
    assert all(p.main_grad.abs().sum() > 0 for layer in layers for n, p in
               layer.named_parameters() if not n.endswith("attention.key.bias"))
    del buffer  # its hooks added every gradient above
