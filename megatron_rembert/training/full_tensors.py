"""Loading full tensors into the trainer's DeepSpeed engine, at any TP x PP x DP.

The source is a portable checkpoint (megatron_rembert/checkpoint/portable.py, where the format
is written, read and documented) or, for DeepSpeed's own optimizers (fp16, ZeRO-2, fp32
without ZeRO), the trainer's shard files read through `CheckpointReader`. Each rank reads
only its slice of every full tensor and zero-fills its padding rows.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from megatron_rembert.checkpoint.portable import OPTIM_KEYS, PortableReader
from megatron_rembert.checkpoint.specs import ParamSpec
from megatron_rembert.checkpoint.step_folder import StepFolder
from megatron_rembert.parallel import state
from megatron_rembert.training import deepspeed_private


def local_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(global name, parameter) of this rank: the plain model, or this pipeline stage's layers."""
    if hasattr(module, "forward_funcs"):  # DeepSpeed PipelineModule
        return [(layer.pipe_prefix + n, p) for layer in module.forward_funcs
                if hasattr(layer, "pipe_prefix") for n, p in layer.named_parameters()]
    return list(module.named_parameters())


def init_adam_state(st: dict, param: torch.Tensor, step: float) -> None:
    """Adam's state of one tensor as torch's AdamW creates it: every tensor on the parameter's
    device (fused AdamW on CUDA refuses a CPU `step`), `step` a float32 scalar, the moments
    fp32 zeros unless already there."""
    st["step"] = torch.tensor(float(step), dtype=torch.float32, device=param.device)
    for k in OPTIM_KEYS:
        if k not in st:
            st[k] = torch.zeros_like(param, dtype=torch.float32, device=param.device)


class ShardSource(Protocol):
    def local_shard(self, key: str, spec: ParamSpec, tp: int, tp_rank: int) -> torch.Tensor: ...


def load_portable(engine, step: StepFolder) -> None:
    """Load a portable checkpoint folder into a DeepSpeed engine built for any layout."""
    with PortableReader(step.path) as reader:
        load_full_tensors(engine, reader, step.meta)


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


def load_full_tensors(engine, source: ShardSource, meta: dict) -> None:
    """Load full tensors (a PortableReader or a CheckpointReader) into a DeepSpeed engine built
    for any layout. `meta`: the portable meta.json (step, consumed_samples, weights_only,
    optimizer {steps, lr_scheduler, skipped_steps, loss_scale}).

    Sets the module weights, the optimizer's fp32 master weights and (unless weights only)
    Adam's moments and step counts, the LR schedule and the engine's counters. Works for ZeRO
    stage 1/2 (through DeepSpeed's tensor-fragment API) and for a plain torch optimizer.
    """
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    weights_only = bool(meta.get("weights_only"))
    num_layers = int(meta["config"]["model"]["num_hidden_layers"])
    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)  # the torch optimizer inside DeepSpeed's wrapper
    flats = deepspeed_private.fp32_partitions(opt)
    info = meta.get("optimizer") or {}
    steps = info.get("steps") or [0.0] * len(base.param_groups)
    if not weights_only and flats is not None:
        for group, flat in enumerate(flats):  # Adam's state is created lazily: create it now
            init_adam_state(base.state.setdefault(flat, {}), flat, steps[group])
        deepspeed_private.relink_optimizer_state(opt)
    group_of = {id(p): g for g, grp in enumerate(base.param_groups) for p in grp["params"]}
    tp, tp_rank = state.tp_size(), state.tp_rank()
    for name, param in local_parameters(engine.module):
        spec = ParamSpec.of(name, param, num_layers)
        value = source.local_shard(name, spec, tp, tp_rank).to(param.device)
        with torch.no_grad():
            param.copy_(value.to(param.dtype))
        safe_set_full_fp32_param(param, value.float())
        if weights_only:
            continue
        for key in OPTIM_KEYS:
            value = source.local_shard(f"{key}/{name}", spec, tp, tp_rank).to(param.device)
            if flats is not None:
                safe_set_full_optimizer_state(param, value.float(), key)
            else:  # plain torch optimizer: the module parameters are the master weights
                st = base.state.setdefault(param, {})
                init_adam_state(st, param, steps[group_of[id(param)]])
                st[key].copy_(value)
    if weights_only:
        return
    restore_schedule(engine, meta, info)
    # the whole scaler state where the checkpoint holds it (ours), else its scale
    saved = info.get("loss_scaler") or ({"cur_scale": float(info["loss_scale"])}
                                        if info.get("loss_scale") is not None else {})
    deepspeed_private.set_loss_scaler_state(opt, saved)
