"""Every private DeepSpeed name the trainer relies on, in one place, checked at start-up.

DeepSpeed's public API does not reach what the trainer needs (our stage split for the pipeline,
the BF16 optimizer's flat fp32 buffers, a hang report per pipeline instruction), so a few
private attributes are used. Their behaviour is what DeepSpeed 0.19 does; `check_private_names`
fails at start-up, naming the installed version and the missing name, instead of a run failing
later in an AttributeError or, worse, training differently.
"""

from __future__ import annotations

from pathlib import Path

# class path -> the private names we use on it or its instances: methods and class attributes,
# or instance attributes its code assigns (`self._topo = ...`). tests/training/
# test_deepspeed_private.py derives the names the package uses from its code and checks that
# each is here (or in the built-optimizer tables below) and used in no other module.
PRIVATE_NAMES = {
    "deepspeed.runtime.pipe.module.PipelineModule": ("_partition_layers", "_set_bounds",
                                                     "_topo"),
    "deepspeed.runtime.pipe.engine.PipelineEngine": ("_INSTRUCTION_MAP",),
    # copies zero_to_fp32.py into a ZeRO checkpoint mid-save (training/checkpoint.py holds
    # its failure like the engine's other writes); `_config`: what a checkpoint engine is
    # built from
    "deepspeed.runtime.engine.DeepSpeedEngine": ("_copy_recovery_script", "_config"),
    # `_hp_mapping`: where a parameter's fragment lies in the flat fp32 partition
    "deepspeed.runtime.bf16_optimizer.BF16_Optimizer": (
        "_lazy_init_hp_params_optimizer_state", "_global_grad_norm", "_hp_mapping"),
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer": (
        "_lazy_init_hp_params_optimizer_state", "_link_all_hp_params", "_global_grad_norm",
        "_hp_mapping"),
}
# Instance attributes of a built BF16_Optimizer that training/main_grads.py reads.
BF16_BUFFERS = ("bf16_groups", "fp32_groups_gradients", "fp32_groups_gradients_flat",
                "fp32_groups_flat_partition", "fp32_groups_gradient_flat_partition",
                "update_lp_params", "optimizer", "clip_grad", "overflow",
                "_hp_optimizer_states_linked")
# Instance attributes of a built DeepSpeedZeroOptimizer that training/main_grads.py reads or
# replaces (fp32 weights, ZeRO-1).
ZERO1_BUFFERS = ("bit16_groups", "bit16_groups_flat", "parallel_partitioned_bit16_groups",
                 "single_partition_of_fp32_groups", "real_dp_process_group", "groups_padding",
                 "partition_gradients", "cpu_offload", "dtype", "master_weights_and_grads_dtype",
                 "torch_autocast_gradscaler", "_grad_acc_hooks", "update_lp_params",
                 "optimizer", "clip_grad", "overflow", "_hp_optimizer_states_linked")
# (lp-parameter groups, flat fp32 partitions) of the wrappers that partition: ZeRO 1 and 2,
# and the BF16_Optimizer (training/lamb.py and training/full_tensors.py read them).
FLAT_PARTITIONS = (("bit16_groups", "single_partition_of_fp32_groups"),
                   ("bf16_groups", "fp32_groups_flat_partition"))
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


def check_bf16_optimizer(optimizer) -> None:
    """The built BF16_Optimizer has the buffers training/main_grads.py works on."""
    for name in BF16_BUFFERS:
        if not hasattr(optimizer, name):
            raise _missing(f"{type(optimizer).__name__} has no attribute {name}")


def is_fp32_zero1(optimizer) -> bool:
    """DeepSpeedZeroOptimizer at ZeRO-1 with fp32 weights, master weights and gradients, nothing
    offloaded: the wrapper training/main_grads.py can take the gradient path of."""
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return False
    for name in ZERO1_BUFFERS:
        if not hasattr(optimizer, name):
            raise _missing(f"{type(optimizer).__name__} has no attribute {name}")
    return (not optimizer.partition_gradients and not optimizer.cpu_offload
            and optimizer.dtype == torch.float32
            and optimizer.master_weights_and_grads_dtype == torch.float32
            and optimizer.torch_autocast_gradscaler is None
            and not getattr(optimizer, "zenflow", False))


def replace_fp32_partitions(optimizer, masters: list) -> None:
    """Make `masters` (one flat fp32 tensor per parameter group, of the partitions' sizes) the
    ZeRO optimizer's master partitions, before its first step: the inner optimizer steps them,
    DeepSpeed saves and loads them, and each parameter's fragment mapping points into them.
    A master that is a slice of a larger buffer is saved as a copy of its own (torch.save
    writes a view's whole storage: every DP rank would write the whole model)."""
    from deepspeed.checkpoint.constants import SINGLE_PARTITION_OF_FP32_GROUPS

    if optimizer.optimizer.state:
        raise RuntimeError("ZeRO's master partitions can only be replaced before the first step")
    for i, master in enumerate(masters):
        old = optimizer.single_partition_of_fp32_groups[i]
        if master.shape != old.shape or master.dtype != old.dtype:
            raise RuntimeError(f"ZeRO's master partition {i} is {tuple(old.shape)} {old.dtype}, "
                               f"the replacement {tuple(master.shape)} {master.dtype}")
        optimizer.single_partition_of_fp32_groups[i] = master
        optimizer.optimizer.param_groups[i]["params"] = [master]
    optimizer._link_all_hp_params()
    optimizer._hp_optimizer_states_linked = False
    state_dict = optimizer.state_dict

    def state_dict_of_own_partitions():
        sd = state_dict()
        sd[SINGLE_PARTITION_OF_FP32_GROUPS] = [
            t.clone() if t.untyped_storage().nbytes()
            > (t.numel() + optimizer.groups_padding[i]) * t.element_size() else t
            for i, t in enumerate(sd[SINGLE_PARTITION_OF_FP32_GROUPS])]
        return sd

    optimizer.state_dict = state_dict_of_own_partitions


def remove_zero_gradient_hooks(optimizer) -> None:
    """Remove the ZeRO optimizer's per-parameter gradient hooks (they copy each gradient into
    its reduction buckets)."""
    for handle in optimizer._grad_acc_hooks:
        handle.remove()
    optimizer._grad_acc_hooks.clear()


def relink_optimizer_state(optimizer) -> None:
    """Point every parameter's fragment mapping at the optimizer's current state tensors (done
    lazily after the first step; again after the state was replaced, e.g. by a load)."""
    optimizer._hp_optimizer_states_linked = False
    optimizer._lazy_init_hp_params_optimizer_state()


def link_optimizer_state_once(optimizer) -> None:
    """What DeepSpeed's BF16_Optimizer.step does after the first optimizer step."""
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
    """The engine no longer all-reduces gradients after backward (main_grads.py does it once
    per step, in place)."""
    if pipeline:
        engine.pipeline_enable_backward_allreduce = False
    else:
        engine.enable_backward_allreduce = False


def engine_config(engine):
    """The engine's parsed DeepSpeedConfig (what a checkpoint engine is built from)."""
    return engine._config


def set_global_grad_norm(optimizer, norm: float) -> None:
    """The norm the engine reports (`get_global_grad_norm`) for the step just taken."""
    optimizer._global_grad_norm = norm


def fp32_partitions(optimizer) -> list | None:
    """This rank's flat fp32 partitions of a partitioning wrapper (ZeRO or BF16_Optimizer);
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


def route_recovery_script_copy(engine, held) -> None:
    """DeepSpeed's save copies its recovery scripts (rank 0, between the ZeRO files and the
    final barrier) outside its checkpoint engine: that copy now runs as
    `held(copy, save_path)`."""
    copy = engine._copy_recovery_script
    engine._copy_recovery_script = lambda save_path: held(copy, save_path)
