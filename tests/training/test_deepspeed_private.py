"""The private DeepSpeed names the trainer relies on live in training/deepspeed_private.py and
are checked at start-up: the installed DeepSpeed passes, a DeepSpeed without one of them fails
naming its version and the name, and no other module of the package uses one."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import deepspeed
import pytest

from megatron_rembert.training import deepspeed_private as dsp

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rembert"
ATTRIBUTE_CALLS = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@functools.cache
def _defined_names(root: Path) -> frozenset[str]:
    """Private names the code under `root` defines: functions, classes, and what it assigns
    (`_X = ...`, `x._y = ...`)."""
    names = set()
    for path in root.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign)
                       else [])
            for target in targets:
                for t in ast.walk(target):
                    names.add(t.attr if isinstance(t, ast.Attribute)
                              else t.id if isinstance(t, ast.Name) else "")
    return frozenset(n for n in names if _private(n))


def _deepspeed_names_used(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Per module of the package: the private names of DeepSpeed's code it reads, writes or
    calls (`x._name`, or `getattr(x, "_name")` and kin), found in the code itself. A name
    the package defines too counts only on another object than `self`/`cls`; attributes of
    modules other than DeepSpeed's (`os._exit`) do not count."""
    deepspeed_names = _defined_names(Path(deepspeed.__file__).parent)
    ours = _defined_names(package)
    used = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = {alias.asname or alias.name.split(".")[0]
                   for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for alias in node.names if not alias.name.startswith("deepspeed")}
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in deepspeed_names:
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if owner in modules or (owner in ("self", "cls") and node.attr in ours):
                    continue
                names.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ATTRIBUTE_CALLS and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant)
                  and node.args[1].value in deepspeed_names):
                names.add(node.args[1].value)
        if names:
            used[str(path.relative_to(package))] = names
    return used


def test_the_installed_deepspeed_has_every_name():
    dsp.check_private_names()


def test_a_missing_name_is_named_with_the_version(monkeypatch):
    from deepspeed.runtime.pipe.module import PipelineModule

    monkeypatch.delattr(PipelineModule, "_set_bounds")
    with pytest.raises(dsp.DeepSpeedVersionError) as err:
        dsp.check_private_names()
    assert f"DeepSpeed {deepspeed.__version__}" in str(err.value)
    assert "PipelineModule has no _set_bounds" in str(err.value)


def test_private_names_are_used_in_one_module_and_each_is_checked_at_start_up():
    used = _deepspeed_names_used()
    assert set(used) == {"training/deepspeed_private.py"}, used
    checked = {n for names in dsp.PRIVATE_NAMES.values() for n in names}
    assert used["training/deepspeed_private.py"] <= checked, (
        used["training/deepspeed_private.py"] - checked)


def test_the_scan_finds_a_private_name_used_elsewhere(tmp_path):
    """The scan above is not blind: a module reading an engine's `_config`, or calling
    `getattr(opt, "_global_grad_norm")`, is found."""
    package = tmp_path / "megatron_rembert"
    (package / "training").mkdir(parents=True)
    (package / "training" / "deepspeed_private.py").write_text("")
    (package / "x.py").write_text("import os\n\n\ndef f(engine, opt):\n"
                                  "    os._exit(0)\n"
                                  "    return engine._config, getattr(opt, '_global_grad_norm')\n")
    assert _deepspeed_names_used(package) == {"x.py": {"_config", "_global_grad_norm"}}


def test_an_instance_attribute_deepspeed_no_longer_assigns_is_named(monkeypatch):
    monkeypatch.setitem(dsp.PRIVATE_NAMES, "deepspeed.runtime.engine.DeepSpeedEngine",
                        ("_config", "_no_such_attribute"))
    with pytest.raises(dsp.DeepSpeedVersionError, match="DeepSpeedEngine has no "
                                                        "_no_such_attribute"):
        dsp.check_private_names()


# DeepSpeedEngine's documented API (deepspeed.readthedocs.io: Training API, Pipeline Parallelism)
# and torch's nn.Module methods: what the package may touch on an engine without listing it.
DOCUMENTED = {"module", "optimizer", "lr_scheduler", "train", "eval", "backward", "step",
              "no_sync", "train_batch", "eval_batch", "parameters", "named_parameters"}


def _engine_attributes_used(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Per module: the attributes it reads or sets on a DeepSpeed engine (`engine.x`,
    `self.engine.x`) or on the engine's module (`engine.module.x`)."""
    def is_engine(node) -> bool:
        return ((isinstance(node, ast.Name) and node.id == "engine")
                or (isinstance(node, ast.Attribute) and node.attr == "engine"))

    used = {}
    for path in sorted(package.rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            if is_engine(node.value):
                names.add(node.attr)
            elif (isinstance(node.value, ast.Attribute) and node.value.attr == "module"
                  and is_engine(node.value.value)):
                names.add(node.attr)
        if names - DOCUMENTED:
            used[str(path.relative_to(package))] = names - DOCUMENTED
    return used


def test_every_engine_attribute_outside_the_documented_api_is_checked_at_start_up():
    """The engine's and its module's attributes the package sets or reads beyond DeepSpeed's
    documented API are ENGINE_ATTRIBUTES (checked on the built engine by `check_engine`), or
    private names (the scan above)."""
    listed = {n for names in dsp.ENGINE_ATTRIBUTES.values() for n in names}
    private = {n for names in dsp.PRIVATE_NAMES.values() for n in names}
    for module, names in _engine_attributes_used().items():
        assert names <= listed | private, (module, names - listed - private)
    assert listed <= {n for names in _engine_attributes_used().values() for n in names}


class _Engine:
    """Stands for a built engine in `check_engine`."""

    def __init__(self, optimizer, **attributes):
        self.optimizer, self.module = optimizer, object()
        self.__dict__.update(attributes)


def test_check_engine_refuses_a_wrapped_optimizer_and_a_missing_attribute(monkeypatch):
    """`_Engine` stands for DeepSpeedEngine here (and no pipeline class matches it)."""
    ours = object()
    monkeypatch.setattr(dsp, "_class", lambda path: _Engine if "DeepSpeedEngine" in path
                        else type("Other", (), {}))
    with pytest.raises(dsp.DeepSpeedVersionError, match="wrapped the client optimizer into"):
        dsp.check_engine(_Engine(object()), ours)
    with pytest.raises(dsp.DeepSpeedVersionError, match="has no attribute global_samples"):
        dsp.check_engine(_Engine(ours, global_steps=0, skipped_steps=0), ours)
    dsp.check_engine(_Engine(ours, global_steps=0, skipped_steps=0, global_samples=0), ours)


def test_an_engine_that_no_longer_reads_overflow_is_refused(monkeypatch):
    monkeypatch.setattr(dsp, "_sources", lambda cls: ["self.optimizer.step()"])
    monkeypatch.setattr(dsp, "_assigns", lambda cls, name: True)
    with pytest.raises(dsp.DeepSpeedVersionError, match="no longer reads a client "
                                                        "optimizer's overflow"):
        dsp.check_private_names()
