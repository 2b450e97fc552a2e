"""Loading a portable checkpoint into the trainer's engine, at any TP x PP x DP.

The portable format (written by `python -m megatron_rembert.convert from-hf` or `reshard`;
see docs/convert.md) stores full tensors per pipeline layer in safetensors, with the
vocabulary padding stripped:

    step_XXXXXXXX/
        layer_00.safetensors   embeddings; layer_{i+1}: Transformer layer i; layer_{L+1}: head
                               tensors: NAME (fp32 master weight, or the weight as given),
                               exp_avg/NAME, exp_avg_sq/NAME (absent when weights only)
        index.json             tensor name -> file
        meta.json              config, layout, step, consumed_samples, format, weights_only,
                               optimizer {steps, lr_scheduler, ...}
        complete

Each rank reads only its slice (`safe_open(...).get_slice`) and zero-fills its padding rows,
which is exact: padded rows have zero weight, gradient and Adam moments in training. The
reader lives here, beside the trainer's own checkpoints; the writers live in convert/.
"""

from __future__ import annotations

import json
import struct
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from megatron_rembert.parallel import state
from megatron_rembert.training.checkpoint import CheckpointError

PORTABLE_FORMAT = "megatron-rembert-portable-v1"
OPTIM_KEYS = ("exp_avg", "exp_avg_sq")


@contextmanager
def safe_open_checked(path: str | Path):
    """`safetensors.safe_open` that names the file when it is missing, truncated or corrupt."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as err:  # noqa: BLE001 - safetensors raises several error types
        raise CheckpointError(f"{path}: not a valid safetensors file ({err}); it may be "
                           "truncated: copy it again") from err
    _check_safetensors_size(path)
    with handle as f:
        yield f


def _check_safetensors_size(path: Path) -> None:
    """safe_open maps the file lazily; check up front that every tensor's bytes are there."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
              default=0)
    if path.stat().st_size < 8 + n + end:
        raise CheckpointError(f"{path}: truncated ({path.stat().st_size} bytes, the header "
                           f"promises {8 + n + end}); copy it again")


def read_index(folder: Path) -> dict[str, str]:
    path = folder / "index.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable ({err})") from err


# -- loading inside the trainer --------------------------------------------------------------
def local_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(global name, parameter) of this rank: the plain model, or this pipeline stage's layers."""
    if hasattr(module, "forward_funcs"):  # DeepSpeed PipelineModule
        return [(layer.pipe_prefix + n, p) for layer in module.forward_funcs
                if hasattr(layer, "pipe_prefix") for n, p in layer.named_parameters()]
    return list(module.named_parameters())


def read_local_shard(f, key: str, param: nn.Parameter) -> torch.Tensor:
    """This TP rank's slice of a stored full tensor; vocabulary padding rows zero-filled."""
    full_shape = tuple(getattr(param, "full_shape", tuple(param.shape)))
    split = getattr(param, "tp_split_dim", None)
    stored = tuple(f.get_slice(key).get_shape())
    rows = getattr(param, "vocab_rows", full_shape[0])
    if stored != (rows, *full_shape[1:]):
        raise CheckpointError(f"{key}: stored shape {stored}, the model expects "
                           f"{(rows, *full_shape[1:])}")
    tp, rank = state.tp_size(), state.tp_rank()
    if split == 1:
        n = full_shape[1] // tp
        return f.get_slice(key)[:, rank * n:(rank + 1) * n]
    start, n = (rank * (full_shape[0] // tp), full_shape[0] // tp) if split == 0 else (0, rows)
    real_end = min(start + n, rows)
    out = torch.zeros((n, *full_shape[1:]))
    if real_end > start:
        out[: real_end - start] = f.get_slice(key)[start:real_end]
    if split is None and rows < full_shape[0]:
        out = torch.cat([out, torch.zeros((full_shape[0] - rows, *full_shape[1:]))])
    return out


def init_adam_state(st: dict, param: torch.Tensor, step: float) -> None:
    """Adam's state of one tensor as torch's AdamW creates it: every tensor on the parameter's
    device (fused AdamW on CUDA refuses a CPU `step`), `step` a float32 scalar, the moments
    fp32 zeros unless already there."""
    st["step"] = torch.tensor(float(step), dtype=torch.float32, device=param.device)
    for k in OPTIM_KEYS:
        if k not in st:
            st[k] = torch.zeros_like(param, dtype=torch.float32, device=param.device)


def load_portable(engine, folder: Path, meta: dict) -> None:
    """Load a portable checkpoint into a DeepSpeed engine built for any layout.

    Sets the module weights, the optimizer's fp32 master weights and (unless weights only)
    Adam's moments and step counts, the LR schedule and the engine's counters. Works for ZeRO
    stage 1/2 (through DeepSpeed's tensor-fragment API) and for a plain torch optimizer.
    """
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    index = read_index(folder)
    weights_only = bool(meta.get("weights_only"))
    params = local_parameters(engine.module)
    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)  # the torch optimizer inside DeepSpeed's wrapper
    flats = (getattr(opt, "single_partition_of_fp32_groups", None)
             or getattr(opt, "fp32_groups_flat_partition", None))
    info = meta.get("optimizer") or {}
    steps = info.get("steps") or [0.0] * len(base.param_groups)
    if not weights_only and flats is not None:
        for group, flat in enumerate(flats):  # Adam's state is created lazily: create it now
            init_adam_state(base.state.setdefault(flat, {}), flat, steps[group])
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    group_of = {id(p): g for g, grp in enumerate(base.param_groups) for p in grp["params"]}
    handles: dict[str, object] = {}
    try:
        for name, param in params:
            for key in [name] + ([] if weights_only else [f"{k}/{name}" for k in OPTIM_KEYS]):
                if key not in index:
                    raise CheckpointError(f"{folder / 'index.json'}: no tensor {key}")
                file = index[key]
                if file not in handles:
                    ctx = safe_open_checked(folder / file)
                    handles[file] = (ctx, ctx.__enter__())
                value = read_local_shard(handles[file][1], key, param).to(param.device)
                if key == name:
                    with torch.no_grad():
                        param.copy_(value.to(param.dtype))
                    safe_set_full_fp32_param(param, value.float())
                elif flats is not None:
                    safe_set_full_optimizer_state(param, value.float(), key.split("/")[0])
                else:  # plain torch optimizer: the module parameters are the master weights
                    st = base.state.setdefault(param, {})
                    init_adam_state(st, param, steps[group_of[id(param)]])
                    st[key.split("/")[0]].copy_(value)
    finally:
        for ctx, _ in handles.values():
            ctx.__exit__(None, None, None)
    if weights_only:
        return
    if info.get("lr_scheduler") and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(info["lr_scheduler"])
        for group, lr in zip(base.param_groups, info["lr_scheduler"]["_last_lr"], strict=True):
            group["lr"] = lr
    engine.global_steps = int(meta["step"])
    engine.global_samples = int(meta["consumed_samples"])
    engine.skipped_steps = int(info.get("skipped_steps", 0))
    scaler = getattr(opt, "loss_scaler", None)
    if scaler is not None and info.get("loss_scale") is not None and hasattr(scaler, "cur_scale"):
        scaler.cur_scale = float(info["loss_scale"])
