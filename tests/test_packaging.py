"""Packaging as users expect: every console script of pyproject.toml runs its command line
under its own name, the README names them all, nothing in the package, the data tools, the
tests or the docs edits sys.path, and DeepSpeed is bounded to the versions CI proves."""

import ast
import importlib
import importlib.metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
SCRIPTS = PROJECT["scripts"]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_console_script_runs_its_command_line(name, monkeypatch, capsys):
    module, function = SCRIPTS[name].split(":")
    main = getattr(importlib.import_module(module), function)
    monkeypatch.setattr("sys.argv", [f"/venv/bin/{name}", "--help"])
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {name} "), name


def test_readme_names_every_console_script():
    readme = (ROOT / "README.md").read_text()
    assert not [name for name in SCRIPTS if name not in readme]


def test_nothing_edits_sys_path():
    """bench/ keeps its own: its scripts run from a bare checkout on GPU machines where the
    package is not installed (bench/gpu_checks.sh)."""
    files = [ROOT / "train.py"] + [p for folder in ("megatron_rembert", "data_tools", "tests",
                                                    "docs") for p in (ROOT / folder).rglob("*.py")]
    edits = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in files
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "path"
             and isinstance(node.value, ast.Name) and node.value.id == "sys"]
    assert not edits, f"sys.path used in {edits}; install the package (pip install -e .)"


def test_deepspeed_is_bounded_to_what_ci_proves():
    (spec,) = [Requirement(r) for r in PROJECT["dependencies"]
               if Requirement(r).name == "deepspeed"]
    assert any(s.operator == "<" for s in spec.specifier), spec  # an upper bound
    assert spec.specifier.contains(importlib.metadata.version("deepspeed")), spec
