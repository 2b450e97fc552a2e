"""Loading full tensors into the trainer's optimizer, at any TP x PP x DP.

The source is a portable checkpoint (megatron_rembert/checkpoint/portable.py, where the format
is written, read and documented). Each rank reads only its slice of every full tensor.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from megatron_rembert.checkpoint.portable import OPTIM_KEYS
from megatron_rembert.checkpoint.specs import ParamSpec
from megatron_rembert.parallel import state


def local_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(global name, parameter) of this rank: the plain model, or this pipeline stage's layers."""
    if hasattr(module, "forward_funcs"):  # DeepSpeed PipelineModule
        return [(layer.pipe_prefix + n, p) for layer in module.forward_funcs
                if hasattr(layer, "pipe_prefix") for n, p in layer.named_parameters()]
    return list(module.named_parameters())


class ShardSource(Protocol):
    def local_shard(self, key: str, spec: ParamSpec, tp: int, tp_rank: int) -> torch.Tensor: ...


def restore_schedule(engine, meta: dict, info: dict) -> None:
    """The LR schedule and the engine's counters of a checkpoint (`info`: its optimizer
    meta: lr_scheduler, skipped_steps)."""
    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)
    if info.get("lr_scheduler") and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(info["lr_scheduler"])
        for group, lr in zip(base.param_groups, info["lr_scheduler"]["_last_lr"], strict=True):
            group["lr"] = lr
    engine.global_steps = int(meta["step"])
    engine.global_samples = int(meta["consumed_samples"])
    engine.skipped_steps = int(info.get("skipped_steps", 0))


def load_into_fragments(engine, source: ShardSource, meta: dict) -> None:
    """Full tensors (a portable checkpoint) into our distributed optimizer
    (training/data_parallel.py): each rank cuts its fragments from its TP shard of every
    tensor; the weights follow from the masters. Weights only: fresh optimizer state, step 0."""
    opt = engine.optimizer
    weights_only = bool(meta.get("weights_only"))
    info = meta.get("optimizer") or {}
    num_layers = int(meta["config"]["model"]["num_hidden_layers"])
    named = {id(p): (n, ParamSpec.of(n, p, num_layers)) for n, p in local_parameters(engine.module)}
    tp, tp_rank = state.tp_size(), state.tp_rank()
    keys = ("master",) if weights_only else ("master", *OPTIM_KEYS)
    states = []
    for f in opt.all_fragments():
        name, spec = named[id(f.param)]
        states.append({
            key: source.local_shard(name if key == "master" else f"{key}/{name}", spec, tp,
                                    tp_rank).reshape(-1)[f.param_start:f.param_start + f.numel]
            for key in keys})
    steps = [] if weights_only else (info.get("steps") or [0])
    inner_step = int(steps[0]) if steps else 0
    opt.load_fragment_states(states, inner_step, inner_step, int(info.get("skipped_steps", 0)))
    if not weights_only:
        restore_schedule(engine, meta, info)
