"""Optimizer, learning-rate schedule and the DeepSpeed config dict, all from our Config."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from megatron_rembert.checkpoint.specs import no_weight_decay
from megatron_rembert.config import ConfigError
from megatron_rembert.parallel import state
from megatron_rembert.parallel.layout import Layout
from megatron_rembert.run_config.schema import Config
from megatron_rembert.training.lamb import Lamb

# Keys of the DeepSpeed config that our Config owns, and the key of ours that sets each: a
# ds_config JSON may not set them (DeepSpeed would take them, or we would silently overwrite
# them: one source of truth for every number).
OWNED_DS_KEYS = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size and train.micro_batch_size",
    "optimizer": "optim.* (name, lr, beta1, beta2, eps, weight_decay)",
    "scheduler": "optim.* (warmup_steps, decay, decay_start_step, min_lr)",
    "gradient_clipping": "optim.clip_grad",
    "bf16.enabled": "train.precision",
    "fp16.enabled": "train.precision",
    "zero_optimization.stage": "parallel.zero_stage",
    "steps_per_print": "train.log_interval",
}


def load_ds_config(path: str | Path) -> dict:
    """The user's DeepSpeed JSON, refused (ConfigError naming the file and key) if it is
    missing, not a JSON object, or sets a key of OWNED_DS_KEYS."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"parallel.ds_config={path}: no such file")
    try:
        ds = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"parallel.ds_config={path}: not valid JSON ({err})") from err
    if not isinstance(ds, dict):
        raise ConfigError(f"parallel.ds_config={path}: expected a JSON object, got "
                          f"{type(ds).__name__}")
    for key in OWNED_DS_KEYS:
        parent, _, leaf = key.rpartition(".")
        section = ds.get(parent) if parent else ds
        if isinstance(section, dict) and leaf in section:
            raise ConfigError(f"parallel.ds_config={path} sets {key}, which our config owns: "
                              f"remove it from the JSON and set {OWNED_DS_KEYS[key]} instead")
    return ds


def deepspeed_config(config: Config, layout: Layout) -> dict:
    """The DeepSpeed config dict: the optional JSON's knobs plus every number from our Config
    and the layout."""
    ds = load_ds_config(config.parallel.ds_config) if config.parallel.ds_config else {}
    train = config.train
    ds.update(train_batch_size=layout.global_batch_size,
              train_micro_batch_size_per_gpu=layout.micro_batch_size,
              gradient_accumulation_steps=layout.gas,
              gradient_clipping=config.optim.clip_grad,
              steps_per_print=10**9)  # our own logging replaces DeepSpeed's
    # On DeepSpeed's own path (fp16, ZeRO-2; training/data_parallel.py replaces these settings
    # for the others) gradients accumulate over micro-batches in fp32 (DeepSpeed's default
    # accumulates in half precision), and are summed over DP ranks in fp32: a bf16 sum
    # over ranks moved a parameter 2e-3 (relative) differently from one process already at
    # dp = 2, and Megatron-LM reduces in fp32 under bf16 too.
    accum = ds.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
    if accum not in ("fp32", "float32"):
        raise ConfigError(f"{config.parallel.ds_config}: data_types.grad_accum_dtype={accum!r}; "
                          "gradients are accumulated in fp32: remove the key")
    if train.precision != "fp32":
        ds.setdefault("communication_data_type", "fp32")
    ds.setdefault("bf16", {})["enabled"] = train.precision == "bf16"
    ds.setdefault("fp16", {})["enabled"] = train.precision == "fp16"
    ds.setdefault("zero_optimization", {})["stage"] = config.parallel.zero_stage
    if config.optim.name == "lamb":
        ds["zero_allow_untested_optimizer"] = True  # Lamb maps ZeRO's partitions itself
    return ds


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
