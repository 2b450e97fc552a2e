"""Every private DeepSpeed name the trainer relies on, in one place, checked at start-up.

DeepSpeed's public API does not reach what the trainer needs (our stage split for the pipeline,
a hang report per pipeline instruction, and on DeepSpeed's own ZeRO path, fp16 and ZeRO-2, its
flat fp32 partitions for LAMB, for saving them in our checkpoint and for loading full tensors,
and the fp16 loss scaler's state), so
a few private attributes are used (the production path's gradients and optimizer step,
training/data_parallel.py, go through the engine's public API only). Their behaviour is what
DeepSpeed 0.19 does; `check_private_names` fails at start-up, naming the installed version and
the missing name, instead of a run failing later in an AttributeError or, worse, training
differently.
"""

from __future__ import annotations

from pathlib import Path

import torch

# The dynamic loss scaler's state (fp16): its scale and where it is in its schedule
# (runtime/fp16/loss_scaler.py); a static scaler has `cur_scale` only.
LOSS_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
# class path -> the private names we use on it or its instances: methods and class attributes,
# or instance attributes its code assigns (`self._topo = ...`). tests/training/
# test_deepspeed_private.py derives the names the package uses from its code and checks that
# each is here and used in no other module.
PRIVATE_NAMES = {
    "deepspeed.runtime.pipe.module.PipelineModule": ("_partition_layers", "_set_bounds",
                                                     "_topo"),
    "deepspeed.runtime.pipe.engine.PipelineEngine": ("_INSTRUCTION_MAP",),
    # `_hp_mapping`: where a parameter's fragment lies in the flat fp32 partition (LAMB);
    # the optimizer state's link to it, renewed after a load
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer": (
        "_lazy_init_hp_params_optimizer_state", "_hp_optimizer_states_linked", "_hp_mapping"),
    # its state saved in our checkpoint (`loss_scaler_state`)
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": LOSS_SCALER_FIELDS,
}
# (lp-parameter groups, flat fp32 partitions) of DeepSpeed's ZeRO 1/2 optimizer (training/
# lamb.py, training/full_tensors.py and `optimizer_pieces` read them).
FLAT_PARTITIONS = (("bit16_groups", "single_partition_of_fp32_groups"),)
SUPPORTED = "0.19"  # the minor version these names were read from (pyproject bounds it too)


class DeepSpeedVersionError(RuntimeError):
    """The installed DeepSpeed lacks a private name the trainer relies on."""


def _version() -> str:
    import deepspeed

    return getattr(deepspeed, "__version__", "unknown")


def _missing(message: str) -> DeepSpeedVersionError:
    return DeepSpeedVersionError(
        f"DeepSpeed {_version()}: {message}; megatron-rembert relies on it as DeepSpeed "
        f"{SUPPORTED}.x has it (megatron_rembert/training/deepspeed_private.py): install "
        f"deepspeed=={SUPPORTED}.*")


def _assigns(cls, name: str) -> bool:
    """Whether the module of `cls`, or of one of its DeepSpeed bases, assigns `x.name = ...`
    (an instance attribute: `hasattr` on the class cannot see it)."""
    import inspect
    import re

    assignment = re.compile(rf"\.{re.escape(name)}\s*(:[^=\n]*)?=(?!=)")
    files = {inspect.getsourcefile(klass) for klass in cls.__mro__
             if klass.__module__.startswith("deepspeed")}
    return any(assignment.search(Path(f).read_text()) for f in files if f)


def check_private_names() -> None:
    """Raise DeepSpeedVersionError naming the first private name this DeepSpeed lacks: not an
    attribute of its class, nor assigned by the class's code."""
    import importlib

    for path, names in PRIVATE_NAMES.items():
        module, _, cls_name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), cls_name, None)
        if cls is None:
            raise _missing(f"no class {path}")
        for name in names:
            if not hasattr(cls, name) and not _assigns(cls, name):
                raise _missing(f"{path} has no {name}")


def relink_optimizer_state(optimizer) -> None:
    """Point every parameter's fragment mapping at the optimizer's current state tensors (done
    lazily after the first step; again after the state was replaced, e.g. by a load)."""
    optimizer._hp_optimizer_states_linked = False
    optimizer._lazy_init_hp_params_optimizer_state()


def pipeline_module_with_boundaries(boundaries: list[int]):
    """A PipelineModule subclass whose stages are `boundaries` (stage i owns pipeline layers
    boundaries[i] .. boundaries[i+1]) instead of DeepSpeed's parameter or layer-count balance."""
    from deepspeed.pipe import PipelineModule

    class PipelineModuleWithBoundaries(PipelineModule):
        def _partition_layers(self, method: str = "") -> None:
            self.parts = list(boundaries)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return PipelineModuleWithBoundaries


def wrap_pipeline_instructions(engine, wrap) -> None:
    """Route every pipeline-schedule instruction through `wrap(kind, run)`. DeepSpeed's
    pipeline engine looks its instructions up in `_INSTRUCTION_MAP` through the instance; an
    instance-level copy wraps them."""
    base = type(engine)._INSTRUCTION_MAP
    engine._INSTRUCTION_MAP = {kind: wrap(kind, run) for kind, run in base.items()}


def disable_engine_gradient_reduction(engine, pipeline: bool) -> None:
    """The engine no longer all-reduces gradients after backward (fp32 without ZeRO on one DP
    rank: nothing to reduce)."""
    if pipeline:
        engine.pipeline_enable_backward_allreduce = False
    else:
        engine.enable_backward_allreduce = False


def fp32_partitions(optimizer) -> list | None:
    """This rank's flat fp32 partitions of a partitioning wrapper (ZeRO 1/2);
    None for a wrapper that keeps none (fp32 without ZeRO)."""
    for _, flats in FLAT_PARTITIONS:
        if getattr(optimizer, flats, None):
            return getattr(optimizer, flats)
    return None


def fragment_address(param):
    """Where this rank's fragment of `param` lies in its flat fp32 partition (`.start`,
    `.numel`), or None when the partition holds none of it (DeepSpeed's `_hp_mapping`)."""
    mapping = getattr(param, "_hp_mapping", None)
    return None if mapping is None else mapping.hp_fragment_address


def optimizer_pieces(optimizer, params: list, dp: int, dp_rank: int) -> list:
    """What this rank saves of DeepSpeed's own optimizer, as checkpoint/optimizer_shards.py
    pieces: fp32 masters and moments by parameter and element range, read in place. ZeRO 1/2:
    each parameter's fragment in this rank's flat fp32 partition (`_hp_mapping`), nothing
    gathered; fp32 without ZeRO (a plain torch optimizer, every DP rank holding all of it):
    the weights are the masters, and DP rank r saves the r-th of dp even parts of each."""
    from megatron_rembert.checkpoint.optimizer_shards import Piece

    pieces = []
    if fp32_partitions(optimizer) is None:
        base = getattr(optimizer, "optimizer", optimizer)
        for p in params:
            lo, hi = p.numel() * dp_rank // dp, p.numel() * (dp_rank + 1) // dp
            if hi > lo:
                moments = {k: v.reshape(-1)[lo:hi] for k, v in base.state.get(p, {}).items()
                           if isinstance(v, torch.Tensor) and v.shape == p.shape}
                pieces.append(Piece(p, lo, hi - lo,
                                    {"master": p.detach().reshape(-1)[lo:hi], **moments}))
        return pieces
    stepped = bool(getattr(optimizer, "optimizer", optimizer).state)  # moments exist
    if stepped:
        relink_optimizer_state(optimizer)  # the fragments' views of the current state
    for p in params:
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:
            continue
        address = mapping.lp_fragment_address
        moments = ({k: mapping.get_hp_fragment(k) for k in mapping.get_optim_state_keys()}
                   if stepped else {})
        pieces.append(Piece(p, address.start, address.numel,
                            {"master": mapping.get_hp_fragment(), **moments}))
    return pieces


def inner_step(optimizer) -> int:
    """The torch optimizer's step count inside DeepSpeed's wrapper (0 before its first)."""
    base = getattr(optimizer, "optimizer", optimizer)
    for st in base.state.values():
        if "step" in st:
            return int(st["step"])
    return 0


def loss_scaler_state(optimizer) -> dict | None:
    """The loss scaler's state (`LOSS_SCALER_FIELDS` it has), or None without a scaler."""
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is None:
        return None
    return {k: float(getattr(scaler, k)) for k in LOSS_SCALER_FIELDS if hasattr(scaler, k)}


def set_loss_scaler_state(optimizer, saved: dict) -> None:
    """Put a `loss_scaler_state` back (the fields this scaler has, in their own types)."""
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is None:
        return
    for key, value in saved.items():
        if key in LOSS_SCALER_FIELDS and hasattr(scaler, key):
            setattr(scaler, key, type(getattr(scaler, key))(value))
