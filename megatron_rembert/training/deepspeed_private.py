"""Every DeepSpeed name the trainer relies on beyond DeepSpeed's documented API, in one place,
checked at start-up.

The gradients and the optimizer step are ours (training/data_parallel.py) and reach DeepSpeed's
engine through its public API; what is left here is what the pipeline engine needs:
- private names: our stage split for the pipeline (`PipelineModule._partition_layers`,
  `_set_bounds`, `_topo`) and a hang report per pipeline instruction
  (`PipelineEngine._INSTRUCTION_MAP`), checked by `check_private_names`;
- the engine's attributes the trainer sets or reads, public in DeepSpeed's code but not in
  its documentation (ENGINE_ATTRIBUTES: the pipeline engine's switch of its gradient
  all-reduce, its module's layers and loss function, the step counters a resume restores),
  and the client optimizer's `overflow` the engine reads after a step, checked on the built
  engine by `check_engine`, which also fails if DeepSpeed wrapped our optimizer in one of its
  own.
Their behaviour is what DeepSpeed 0.19 does; the checks fail at start-up, naming the installed
version and the missing name, instead of a run failing later in an AttributeError or, worse,
training differently. At run time, parallel/grad_buffer.py fails the first step in which a
gradient reached a parameter outside its buffers (what DeepSpeed's own gradient reduction does
to every parameter). tests/training/test_deepspeed_private.py derives the private names the
package uses from its code and checks that each is here and used in no other module.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

# class path -> the private names we use on it or its instances: methods and class attributes,
# or instance attributes its code assigns (`self._topo = ...`).
PRIVATE_NAMES = {
    "deepspeed.runtime.pipe.module.PipelineModule": ("_partition_layers", "_set_bounds",
                                                     "_topo"),
    "deepspeed.runtime.pipe.engine.PipelineEngine": ("_INSTRUCTION_MAP",),
}
# class path -> attributes of its instances the trainer sets or reads (training/engine.py,
# training/full_tensors.py `restore_schedule`).
ENGINE_ATTRIBUTES = {
    "deepspeed.runtime.engine.DeepSpeedEngine": ("global_steps", "global_samples",
                                                 "skipped_steps"),
    "deepspeed.runtime.pipe.engine.PipelineEngine": ("pipeline_enable_backward_allreduce",),
    "deepspeed.runtime.pipe.module.PipelineModule": ("forward_funcs", "loss_fn"),
}
# What the engine reads from a client optimizer after its step: a skipped step is counted and
# the LR schedule left alone (training/distributed_optimizer.py sets it).
CLIENT_OPTIMIZER_READS = ("overflow",)
SUPPORTED = "0.19"  # the minor version these names were read from (pyproject bounds it too)


class DeepSpeedVersionError(RuntimeError):
    """The installed DeepSpeed lacks a name the trainer relies on, or behaves otherwise."""


def _version() -> str:
    import deepspeed

    return getattr(deepspeed, "__version__", "unknown")


def _missing(message: str) -> DeepSpeedVersionError:
    return DeepSpeedVersionError(
        f"DeepSpeed {_version()}: {message}; megatron-rembert relies on it as DeepSpeed "
        f"{SUPPORTED}.x has it (megatron_rembert/training/deepspeed_private.py): install "
        f"deepspeed=={SUPPORTED}.*")


def _sources(cls) -> list[str]:
    """The code of `cls`'s module and of its DeepSpeed bases' modules."""
    files = {inspect.getsourcefile(klass) for klass in cls.__mro__
             if klass.__module__.startswith("deepspeed")}
    return [Path(f).read_text() for f in files if f]


def _assigns(cls, name: str) -> bool:
    """Whether the code of `cls` or of one of its DeepSpeed bases assigns `x.name = ...` (an
    instance attribute: `hasattr` on the class cannot see it)."""
    assignment = re.compile(rf"\.{re.escape(name)}\s*(:[^=\n]*)?=(?!=)")
    return any(assignment.search(code) for code in _sources(cls))


def _class(path: str):
    import importlib

    module, _, cls_name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), cls_name, None)
    if cls is None:
        raise _missing(f"no class {path}")
    return cls


def check_private_names() -> None:
    """Raise DeepSpeedVersionError naming the first name of PRIVATE_NAMES or
    ENGINE_ATTRIBUTES this DeepSpeed lacks (not an attribute of its class, nor assigned by the
    class's code), or if its engine no longer reads a client optimizer's `overflow`."""
    for table in (PRIVATE_NAMES, ENGINE_ATTRIBUTES):
        for path, names in table.items():
            cls = _class(path)
            for name in names:
                if not hasattr(cls, name) and not _assigns(cls, name):
                    raise _missing(f"{path} has no {name}")
    engine = _class("deepspeed.runtime.engine.DeepSpeedEngine")
    for name in CLIENT_OPTIMIZER_READS:
        if not any(re.search(rf"optimizer\.{name}\b", code) for code in _sources(engine)):
            raise _missing(f"its engine no longer reads a client optimizer's {name}")


def check_engine(engine, optimizer) -> None:
    """On the built engine: our optimizer is the engine's own (DeepSpeed constructed none of
    its optimizers around it), and every attribute of ENGINE_ATTRIBUTES that applies to it is
    there."""
    if engine.optimizer is not optimizer:
        raise _missing(f"deepspeed.initialize wrapped the client optimizer into "
                       f"{type(engine.optimizer).__name__}")
    for path, names in ENGINE_ATTRIBUTES.items():
        cls = _class(path)
        target = engine.module if "PipelineModule" in path else engine
        if not isinstance(target, cls):
            continue
        for name in names:
            if not hasattr(target, name):
                raise _missing(f"its {type(target).__name__} has no attribute {name}")


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
