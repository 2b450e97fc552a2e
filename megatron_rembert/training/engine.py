"""The DeepSpeed engine around our model, and one training step over a global batch.

pp = 1: the plain model under DeepSpeed's standard engine (ZeRO 0, 1 or 2).
pp > 1: a `PipelineModule` (1F1B) whose stages are balanced by parameters.

Loss normalisation is layout-independent: the gradient is that of
    sum of per-token losses over the global batch / number of real masked tokens in it,
so each micro-batch's backward gets `loss_sum * gas * dp / global_tokens` (DeepSpeed divides
by the gradient-accumulation steps and averages over DP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from megatron_rembert.model.mlm_head import MLMLoss
from megatron_rembert.model.pipeline import pipeline_layer_builders, pipeline_layer_costs
from megatron_rembert.model.rembert import RemBertForPreTraining
from megatron_rembert.parallel import state
from megatron_rembert.parallel.layers import init_weights, is_tp_sharded
from megatron_rembert.parallel.random import checkpoint_safe
from megatron_rembert.training.config import Config
from megatron_rembert.training.lamb import Lamb
from megatron_rembert.training.optim import build_optimizer, build_scheduler, deepspeed_config

INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "masked_positions")


@dataclass
class StepStats:
    loss: float  # mean cross-entropy over the real masked tokens of the global batch
    mlm_acc: float
    masked_tokens: int  # real masked tokens in the global batch
    grad_norm: float | None = None
    loss_scale: float | None = None
    lr: float | None = None
    skipped: bool = False  # the optimizer step was skipped (fp16 overflow)


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, group=group)
    return t


def _stats_tensor(out: MLMLoss) -> torch.Tensor:
    return torch.stack([out.loss_sum.detach().float(), out.num_tokens.detach().float(),
                        out.num_correct.detach().float()]).cpu()


def _recompute(function, *args):
    """Activation checkpointing for pipeline layers, as for pp = 1 (RemBertModel): torch's
    non-reentrant checkpoint, with the TP dropout stream replayed in the recomputation."""
    return checkpoint(checkpoint_safe(function), *args, use_reentrant=False)


def _build_pipeline(config: Config, dp: int):
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    costs = pipeline_layer_costs(config.model)

    class RemBertPipelineModule(PipelineModule):
        # Balance stages by our analytic parameter counts instead of DeepSpeed's, which builds
        # every layer (the 418M-parameter head included) on every rank to count it.
        def _count_layer_params(self):
            return list(costs)

    topology = PipeModelDataParallelTopology(num_pp=config.parallel.pp, num_mp=config.parallel.tp,
                                             num_dp=dp)
    specs = [LayerSpec(cls, *args) for cls, args in pipeline_layer_builders(config.model)]
    module = RemBertPipelineModule(
        layers=specs, topology=topology, partition_method="parameters",
        activation_checkpoint_interval=1 if config.parallel.activation_checkpointing else 0,
        activation_checkpoint_func=_recompute, checkpointable_layers=["TransformerLayerPipe"])
    for layer in module.forward_funcs:
        init_weights(layer, config.train.seed, config.model.initializer_range,
                     prefix=layer.pipe_prefix)
    return module


class Trainer:
    """Builds the engine; `train_step` runs one global batch given as this rank's micro-batches."""

    def __init__(self, config: Config, dp: int, device: torch.device):
        import deepspeed

        self.config, self.dp, self.device = config, dp, device
        self.pipeline = config.parallel.pp > 1
        if self.pipeline:
            model = _build_pipeline(config, dp)
        else:
            model = RemBertForPreTraining(config.model)
            model.init_weights(config.train.seed)
            model.rembert.activation_checkpointing = config.parallel.activation_checkpointing
        model.to(device)
        optimizer = build_optimizer(model, config)
        scheduler = build_scheduler(optimizer, config)
        self.ds_config = deepspeed_config(config, dp)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config,
            mpu=None if self.pipeline else state.DeepSpeedMPU())
        if isinstance(optimizer, Lamb) and self.optimizer is not optimizer:
            optimizer.use_flat_partitions(self.optimizer)
        self.gas = self.engine.gradient_accumulation_steps()
        self._stats = torch.zeros(3)
        self._loss_factor = 1.0
        if self.pipeline:
            self.engine.module.loss_fn = self._pipeline_loss

    # -- pipeline plumbing ---------------------------------------------------------------
    def _head(self):
        return self.engine.module.forward_funcs[-1]

    def _pipeline_loss(self, masked_hidden: torch.Tensor, labels) -> torch.Tensor:
        out = self._head().loss(masked_hidden, labels)
        self._stats += _stats_tensor(out)
        return out.loss_sum * self._loss_factor

    def _pipeline_items(self, micro_batches: list[dict]):
        for mb in micro_batches:
            yield (tuple(mb[k] for k in INPUT_KEYS),
                   (mb["masked_labels"], mb["masked_weights"]))

    # -- steps ---------------------------------------------------------------------------
    def _to_device(self, mb: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in mb.items()}

    def _global_tokens(self, micro_batches: list[dict]) -> float:
        tokens = torch.tensor([float(sum(mb["masked_weights"].sum() for mb in micro_batches))])
        return _all_reduce(tokens, state.get_state().dp_group).item()

    def _finish_stats(self) -> tuple[float, float, int]:
        stats = self._stats
        if self.pipeline:  # only the last stage computed the loss
            stats = _all_reduce(stats, state.get_state().pp_group)
        stats = _all_reduce(stats, state.get_state().dp_group)
        loss_sum, tokens, correct = stats.tolist()
        tokens = max(tokens, 1.0)
        return loss_sum / tokens, correct / tokens, int(tokens)

    def train_step(self, micro_batches: list[dict]) -> StepStats:
        if len(micro_batches) != self.gas:
            raise ValueError(f"expected {self.gas} micro-batches, got {len(micro_batches)}")
        micro_batches = [self._to_device(mb) for mb in micro_batches]
        self._loss_factor = self.gas * self.dp / max(self._global_tokens(micro_batches), 1.0)
        self._stats = torch.zeros(3)
        skipped_before = self.engine.skipped_steps
        lr = self.scheduler.get_last_lr()[0]  # the rate this step applies
        self.engine.train()
        if self.pipeline:
            self.engine.train_batch(data_iter=self._pipeline_items(micro_batches))
        else:
            own_norm = None  # DeepSpeed clips with the norm at ZeRO 0 but reports None
            for i, mb in enumerate(micro_batches):
                out = self.engine(**mb)
                self._stats += _stats_tensor(out)
                self.engine.backward(out.loss_sum * self._loss_factor)
                if i == len(micro_batches) - 1 and self.config.parallel.zero_stage == 0:
                    own_norm = self._grad_norm()
                self.engine.step()
        loss, acc, tokens = self._finish_stats()
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is None and not self.pipeline:
            grad_norm = own_norm
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = grad_norm.item()
        return StepStats(
            loss=loss, mlm_acc=acc, masked_tokens=tokens,
            grad_norm=None if grad_norm is None or not math.isfinite(grad_norm) else grad_norm,
            loss_scale=self.loss_scale(), lr=lr,
            skipped=self.engine.skipped_steps > skipped_before)

    @torch.no_grad()
    def _grad_norm(self) -> torch.Tensor:
        """Norm of the whole model's gradient (pp = 1, after the DP all-reduce): TP shards
        summed over the TP group, replicated parameters counted once."""
        grads = {True: [], False: []}
        for p in self.engine.module.parameters():
            if p.grad is not None:
                grads[is_tp_sharded(p)].append(p.grad)
        squares = [torch.stack(torch._foreach_norm(g)).float().square().sum() if g
                   else torch.zeros((), device=self.device) for g in (grads[True], grads[False])]
        sharded = _all_reduce(squares[0].reshape(1), state.get_state().tp_group)
        return (sharded[0] + squares[1]).sqrt()

    @torch.no_grad()
    def eval_step(self, micro_batches: list[dict]) -> tuple[float, float, int]:
        """Loss and MLM accuracy over the given micro-batches (all DP ranks together)."""
        micro_batches = [self._to_device(mb) for mb in micro_batches]
        self._stats = torch.zeros(3)
        self.engine.eval()
        if self.pipeline:
            self.engine.eval_batch(data_iter=self._pipeline_items(micro_batches),
                                   num_micro_batches=len(micro_batches))
        else:
            for mb in micro_batches:
                self._stats += _stats_tensor(self.engine(**mb))
        return self._finish_stats()

    def loss_scale(self) -> float | None:
        if self.config.train.precision != "fp16":
            return None
        scale = getattr(self.optimizer, "cur_scale", None)  # DeepSpeed's ZeRO optimizers
        return float(scale) if scale is not None else None
