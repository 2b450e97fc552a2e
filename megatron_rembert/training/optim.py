"""Optimizer and learning-rate schedule, from our Config."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from megatron_rembert.checkpoint.specs import no_weight_decay
from megatron_rembert.parallel import state
from megatron_rembert.run_config.schema import Config
from megatron_rembert.training.lamb import Lamb


def param_groups(named_params, config: Config) -> list[dict]:
    """torch's parameter groups of the parameters that train: with weight decay, and without
    (biases, LayerNorm weights: checkpoint/specs.py `no_weight_decay`)."""
    decay, no_decay = [], []
    for name, param in named_params:
        if param.requires_grad:
            (no_decay if no_weight_decay(name, param.ndim) else decay).append(param)
    return [{"params": decay, "weight_decay": config.optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(config: Config):
    """The function that builds the run's optimizer over given parameter groups."""
    optim = config.optim
    betas = (optim.beta1, optim.beta2)
    if optim.name == "lamb":
        # Ours, not DeepSpeed's FusedLamb: its trust ratios are those of whole parameters
        # under tensor parallelism and ZeRO partitioning, and it runs on CPU as on GPU.
        tp_group = state.tp_group() if state.tp_size() > 1 else None
        return lambda groups: Lamb(groups, lr=optim.lr, betas=betas, eps=optim.eps,
                                   tp_group=tp_group)
    # torch's fused AdamW: on GPU the same multi-tensor kernel as DeepSpeed's or apex's
    # FusedAdam without a CUDA extension to build on the cluster; on CPU (torch >= 2.4) a
    # vectorised kernel, ~20x faster than the default per-tensor loop for a 250k vocabulary.
    return lambda groups: torch.optim.AdamW(groups, lr=optim.lr, betas=betas, eps=optim.eps,
                                            fused=True)


def build_optimizer(model: nn.Module, config: Config) -> torch.optim.Optimizer:
    return make_optimizer(config)(param_groups(model.named_parameters(), config))


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate's stretches: linear warm-up over [0, warmup_steps), the peak `lr`
    until `decay_start` (optim.decay_start_step, 0: right after warm-up; later:
    warmup-stable-decay, Hu et al. 2024, "MiniCPM"), then `decay` to `min_lr` at
    `total_steps`. 1-sqrt: 1 - sqrt(progress), the cooldown of Hägele et al. 2024 ("Scaling
    laws and compute-optimal training beyond fixed training durations")."""

    lr: float
    min_lr: float
    warmup_steps: int
    decay_start: int
    total_steps: int
    decay: str  # linear | cosine | 1-sqrt | constant

    @classmethod
    def of(cls, config: Config) -> LRSchedule:
        optim = config.optim
        return cls(lr=optim.lr, min_lr=optim.min_lr, warmup_steps=optim.warmup_steps,
                   decay_start=max(optim.warmup_steps, optim.decay_start_step),
                   total_steps=config.train.steps, decay=optim.decay)

    def multiplier(self, step: int) -> float:
        """Multiplier of `lr` at a step."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        floor = self.min_lr / self.lr if self.lr else 0.0
        progress = max(0.0, min(1.0, (step - self.decay_start)
                                / max(1, self.total_steps - self.decay_start)))
        if self.decay == "linear":
            shape = 1.0 - progress
        elif self.decay == "1-sqrt":
            shape = 1.0 - math.sqrt(progress)
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * shape


def lr_lambda(config: Config):
    """The multiplier of optim.lr by step of `config`'s schedule (`LRSchedule`), for a config
    other than the run's own (a checkpoint's, when a resume changes the schedule)."""
    return LRSchedule.of(config).multiplier


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: LRSchedule):
    def multiplier(step: int) -> float:
        # A plain function, as LambdaLR keeps it out of its state_dict (a bound method's
        # attributes would be saved into every checkpoint).
        return schedule.multiplier(step)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
