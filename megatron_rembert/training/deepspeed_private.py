"""Every private DeepSpeed name the trainer relies on, in one place, checked at start-up.

DeepSpeed's public API does not reach what the trainer needs (our stage split for the pipeline,
a hang report per pipeline instruction, the checkpoint engine's writes, and on DeepSpeed's own
ZeRO path, fp16 and ZeRO-2, its flat fp32 partitions for LAMB and for loading full tensors), so
a few private attributes are used (the production path's gradients and optimizer step,
training/data_parallel.py, go through the engine's public API only). Their behaviour is what
DeepSpeed 0.19 does; `check_private_names` fails at start-up, naming the installed version and
the missing name, instead of a run failing later in an AttributeError or, worse, training
differently.
"""

from __future__ import annotations

from pathlib import Path

# class path -> the private names we use on it or its instances: methods and class attributes,
# or instance attributes its code assigns (`self._topo = ...`). tests/training/
# test_deepspeed_private.py derives the names the package uses from its code and checks that
# each is here and used in no other module.
PRIVATE_NAMES = {
    "deepspeed.runtime.pipe.module.PipelineModule": ("_partition_layers", "_set_bounds",
                                                     "_topo"),
    "deepspeed.runtime.pipe.engine.PipelineEngine": ("_INSTRUCTION_MAP",),
    # on DeepSpeed's own ZeRO path: copies zero_to_fp32.py into a ZeRO checkpoint mid-save
    # (training/checkpoint.py holds its failure like the engine's other writes)
    "deepspeed.runtime.engine.DeepSpeedEngine": ("_copy_recovery_script",),
    # `_hp_mapping`: where a parameter's fragment lies in the flat fp32 partition (LAMB);
    # the optimizer state's link to it, renewed after a load
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer": (
        "_lazy_init_hp_params_optimizer_state", "_hp_optimizer_states_linked", "_hp_mapping"),
}
# (lp-parameter groups, flat fp32 partitions) of DeepSpeed's ZeRO 1/2 optimizer (training/
# lamb.py and training/full_tensors.py read them).
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


def route_recovery_script_copy(engine, held) -> None:
    """DeepSpeed's save copies its recovery scripts (rank 0, between the ZeRO files and the
    final barrier) outside its checkpoint engine: that copy now runs as
    `held(copy, save_path)`."""
    copy = engine._copy_recovery_script
    engine._copy_recovery_script = lambda save_path: held(copy, save_path)
