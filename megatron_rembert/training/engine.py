"""The DeepSpeed engine around our model, and one training step over a global batch.

pp = 1: the plain model under DeepSpeed's standard engine.
pp > 1: a `PipelineModule` (1F1B) split at the run plan's stage boundaries (balanced by
training FLOPs; training/plan.py).

Every run's gradients take our path (training/data_parallel.py: fp32 main gradients in
buckets, reduce-scattered over DP, a ZeRO-1 distributed optimizer), handed to DeepSpeed as its
client optimizer; in fp16 that optimizer holds the loss scale too (training/loss_scale.py).

Loss normalisation is layout-independent: the gradient is that of
    sum of per-token losses over the global batch / number of real masked tokens in it,
so each micro-batch's backward gets `loss_sum * gas / global_tokens` (DeepSpeed's backward
divides by the gradient-accumulation steps; our buffers sum over DP), times the loss scale in
fp16.

Both branches run a global batch the same way: `_prepare` makes a `_StepContext` (that batch's
loss factor and running statistics), and every micro-batch's `MLMLoss` goes through its
`scaled_loss`: called by us before `engine.backward` for pp = 1, and by the pipeline engine as
its `loss_fn` for pp > 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from megatron_rembert.data import batch
from megatron_rembert.model.embeddings import RemBertEmbeddings
from megatron_rembert.model.mlm_head import MLMHead, MLMLoss
from megatron_rembert.model.pipeline import (
    pipeline_inputs,
    pipeline_layer_builders,
    set_unpadded,
)
from megatron_rembert.model.rembert import RemBertForPreTraining
from megatron_rembert.model.transformer import TransformerLayer
from megatron_rembert.parallel import comm, state
from megatron_rembert.parallel.fp8 import enable_fp8, follow_optimizer
from megatron_rembert.parallel.layers import init_weights
from megatron_rembert.parallel.random import checkpoint_safe
from megatron_rembert.run_config.schema import Config
from megatron_rembert.training import data_parallel, deepspeed_private
from megatron_rembert.training.ds_config import deepspeed_config, load_ds_config
from megatron_rembert.training.full_tensors import local_parameters
from megatron_rembert.training.hang import POSITION
from megatron_rembert.training.optim import build_scheduler
from megatron_rembert.training.plan import RunPlan
from megatron_rembert.training.startup import STARTUP

# The modules that wait for their own weights' all-gather before their forward
# (parallel.overlap_weight_gather): each uses no parameter outside itself in its forward (the
# head's tied table is its own too); the pipeline's layers are subclasses.
GATHER_UNITS = (RemBertEmbeddings, TransformerLayer, MLMHead)


@dataclass
class StepStats:
    loss: float  # mean cross-entropy over the real masked tokens of the global batch
    mlm_acc: float
    masked_tokens: int  # real masked tokens in the global batch
    grad_norm: float | None = None  # None where not reported or not finite
    grad_norm_finite: bool = True  # False when it was reported inf or NaN
    loss_scale: float | None = None
    lr: float | None = None
    skipped: bool = False  # the optimizer step was skipped (fp16 overflow)


class _StepContext:
    """One global batch in flight: its real masked tokens (counted once, from the host
    batches, summed over DP), its loss factor `gas * loss_scale / tokens`, and the running
    [loss_sum, correct] of this rank, all on the training device (no host sync until
    `Trainer._finish_stats`)."""

    def __init__(self, tokens: torch.Tensor, gas: int, loss_scale: float = 1.0):
        self.tokens = tokens
        self.loss_factor = gas * loss_scale / tokens.clamp(min=1.0)
        self.stats = torch.zeros(2, device=tokens.device)

    def scaled_loss(self, out: MLMLoss | tuple, _labels=None) -> torch.Tensor:
        """Count a micro-batch's statistics; its loss sum scaled for backward. Also the
        pipeline engine's `loss_fn(outputs, labels)`: the labels travel with the activations
        (model/pipeline.py), the engine's own label slot is empty."""
        out = MLMLoss(*out)
        self.stats += torch.stack([out.loss_sum.detach().float(),
                                   out.num_correct.detach().float()])
        return out.loss_sum * self.loss_factor


def _recompute(function, *args):
    """Activation checkpointing for pipeline layers, as for pp = 1 (RemBertModel): torch's
    non-reentrant checkpoint, with the TP dropout stream replayed in the recomputation."""
    return checkpoint(checkpoint_safe(function), *args, use_reentrant=False)


def _build_pipeline(config: Config, plan: RunPlan):
    from deepspeed.pipe import LayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    # The plan's stage boundaries (balanced by training FLOPs, the same on every rank) instead
    # of DeepSpeed's methods, which balance parameters or layer counts.
    layout = plan.layout
    module_class = deepspeed_private.pipeline_module_with_boundaries(plan.stage_boundaries)
    topology = PipeModelDataParallelTopology(num_pp=layout.pp, num_mp=layout.tp, num_dp=layout.dp)
    specs = [LayerSpec(cls, *args) for cls, args in pipeline_layer_builders(config.model)]
    module = module_class(
        layers=specs, topology=topology, partition_method="ours",
        activation_checkpoint_interval=1 if config.parallel.activation_checkpointing else 0,
        activation_checkpoint_func=_recompute, checkpointable_layers=["TransformerLayerPipe"])
    for layer in module.forward_funcs:
        init_weights(layer, config.train.seed, config.model.initializer_range,
                     prefix=layer.pipe_prefix)
    return module


class Trainer:
    """Builds the engine; `train_step` runs one global batch given as this rank's micro-batches.

    Step statistics stay on the training device and are read back once per step; every
    collective goes through `parallel.comm`.
    """

    def __init__(self, config: Config, plan: RunPlan, device: torch.device):
        import deepspeed

        deepspeed_private.check_private_names()
        self.config, self.layout, self.device = config, plan.layout, device
        self.pipeline = plan.layout.pp > 1
        if self.pipeline:
            model = _build_pipeline(config, plan)
        else:
            model = RemBertForPreTraining(config.model)
            model.init_weights(config.train.seed)
            model.rembert.activation_checkpointing = config.parallel.activation_checkpointing
        # train.fp8: the Transformer layers' linears multiply in fp8, their cached fp8 weights
        # renewed after each step of this trainer's optimizer (no other's)
        self.fp8_gemms = (enable_fp8(m for m in model.modules() if isinstance(m, TransformerLayer))
                          if config.train.fp8 else [])
        model.to(device, data_parallel.weight_dtype(config))
        user = load_ds_config(config)
        self.ds_config = deepspeed_config(config, plan.layout, user)
        self.grad_buffer, optimizer = data_parallel.build(
            local_parameters(model), config, data_parallel.loss_scaler(user, config))
        STARTUP.mark("model")
        if self.fp8_gemms:
            follow_optimizer(self.fp8_gemms, optimizer)
        scheduler = build_scheduler(optimizer, plan.lr)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler,
            config=self.ds_config,
            mpu=None if self.pipeline else state.DeepSpeedMPU())
        deepspeed_private.check_engine(self.engine, optimizer)
        if self.pipeline:
            self.engine.pipeline_enable_backward_allreduce = False  # the engine's public switch
        if config.parallel.overlap_weight_gather:
            optimizer.overlap_weight_gather(model, GATHER_UNITS)
        if self.pipeline:
            _track_instructions(self.engine)

    # -- pipeline plumbing ---------------------------------------------------------------
    def _pipeline_items(self, micro_batches: list[dict]):
        for i, mb in enumerate(micro_batches):
            POSITION.set(detail=f"loading micro-batch {i + 1}/{len(micro_batches)}")
            # The labels travel with the activations; the engine's own label slot is unused.
            yield pipeline_inputs(mb), ()

    # -- steps ---------------------------------------------------------------------------
    def _prepare(self, micro_batches: list[dict]) -> tuple[list[dict], _StepContext]:
        """Checked, moved to the training device, and the context of this global batch (its
        loss factor `gas * dp / global masked tokens`, kept on the device: no host sync)."""
        for i, mb in enumerate(micro_batches):
            batch.check_micro_batch(mb, f"micro-batch {i}")
        local = sum(float(mb["masked_weights"].sum()) for mb in micro_batches)  # CPU tensors
        tokens = comm.all_reduce(torch.tensor(local, dtype=torch.float32, device=self.device),
                                 group=state.get_state().dp_group)
        step = _StepContext(tokens, self.layout.gas, self.optimizer.loss_scale)
        # `unpadded` becomes a Python bool here, on the host: the model picks the attention
        # call from it, and reading a device tensor would wait for the device. A pipeline runs
        # the step's micro-batches on one path: unpadded when all of them are.
        moved = [{k: bool(v) if k in batch.HOST_KEYS else v.to(self.device, non_blocking=True)
                  for k, v in mb.items()} for mb in micro_batches]
        if self.pipeline:
            set_unpadded(self.engine.module.forward_funcs, all(mb["unpadded"] for mb in moved))
        return moved, step

    def _finish_stats(self, step: _StepContext) -> tuple[float, float, int]:
        stats = step.stats
        if self.pipeline:  # only the last stage computed the loss
            stats = comm.all_reduce(stats, group=state.get_state().pp_group)
        stats = comm.all_reduce(stats, group=state.get_state().dp_group)
        loss_sum, correct, tokens = torch.cat([stats, step.tokens.view(1)]).tolist()  # one read
        tokens = max(tokens, 1.0)
        return loss_sum / tokens, correct / tokens, int(tokens)

    def train_step(self, micro_batches: list[dict]) -> StepStats:
        if len(micro_batches) != self.layout.gas:
            raise ValueError(f"expected {self.layout.gas} micro-batches, got "
                             f"{len(micro_batches)}")
        micro_batches, step = self._prepare(micro_batches)
        # the last step's weights, gathered from here while the forward runs: after the
        # blocking all-reduce above, so that on NCCL nothing queues behind the gather
        self.optimizer.start_weight_gather()
        lr = self.scheduler.get_last_lr()[0]  # the rate this step applies
        self.engine.train()
        if self.pipeline:
            self.engine.module.loss_fn = step.scaled_loss  # on the last stage, per micro-batch
            self.grad_buffer.expect(self.layout.gas)  # this stage's backward passes
            self.engine.train_batch(data_iter=self._pipeline_items(micro_batches))
        else:
            self.forward_backward(micro_batches, step)
            self.engine.step()  # DeepSpeed's boundary step: our optimizer's
        POSITION.set(detail="step statistics")
        loss, acc, tokens = self._finish_stats(step)
        grad_norm = self.optimizer.grad_norm
        return StepStats(
            loss=loss, mlm_acc=acc, masked_tokens=tokens,
            grad_norm=None if grad_norm is None or not math.isfinite(grad_norm) else grad_norm,
            grad_norm_finite=grad_norm is None or math.isfinite(grad_norm),
            loss_scale=self.loss_scale(), lr=lr, skipped=self.optimizer.overflow)

    def forward_backward(self, micro_batches: list[dict], step: _StepContext) -> None:
        """pp = 1: forward and backward of every micro-batch of a step, with DeepSpeed's
        bookkeeping between them; nothing here waits for the device
        (tests/training/test_host_syncs.py)."""
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            POSITION.set(detail=f"micro-batch {i + 1}/{len(micro_batches)}")
            if i == 0:  # each bucket's reduce-scatter starts once its gradients are in
                self.grad_buffer.expect(len(micro_batches))
            loss = step.scaled_loss(self.engine(**mb))
            with self.engine.no_sync():  # our buffers reduce, not DeepSpeed
                self.engine.backward(loss)
            if i < last:
                self.engine.step()  # not an accumulation boundary: counters only

    @torch.no_grad()
    def eval_step(self, micro_batches: list[dict]) -> tuple[float, float, int]:
        """Loss and MLM accuracy over the given micro-batches (all DP ranks together)."""
        micro_batches, step = self._prepare(micro_batches)
        self.optimizer.start_weight_gather()
        self.engine.eval()
        if self.pipeline:
            self.engine.module.loss_fn = step.scaled_loss
            self.engine.eval_batch(data_iter=self._pipeline_items(micro_batches),
                                   num_micro_batches=len(micro_batches))
        else:
            for mb in micro_batches:
                step.scaled_loss(self.engine(**mb))
        return self._finish_stats(step)

    def wait_for_weights(self) -> None:
        """The weights of the last step, all-gathered over DP: before reading them outside a
        forward (the step leaves the all-gather to the next one: training/
        distributed_optimizer.py)."""
        self.optimizer.wait_for_weights()

    def loss_scale(self) -> float | None:
        """fp16's loss scale after the last step (None in other precisions)."""
        scaler = self.optimizer.loss_scaler
        return scaler.cur_scale if scaler is not None else None


def _track_instructions(engine) -> None:
    """Record each pipeline-schedule instruction in POSITION before it runs, so that a hang
    names it."""

    def tracked(kind, run):
        def run_tracked(self, **kwargs):
            args = ", ".join(f"{k}={v}" for k, v in kwargs.items())
            POSITION.set(detail=f"pipeline instruction {kind.__name__}({args})")
            return run(self, **kwargs)
        return run_tracked

    deepspeed_private.wrap_pipeline_instructions(engine, tracked)
