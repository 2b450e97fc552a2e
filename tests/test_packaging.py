"""Packaging as users expect: every console script of pyproject.toml runs its command line
under its own name, the README names them all, nothing in the repository edits the module
search path (bench runs as `python -m bench.<name>`), and DeepSpeed is bounded to the versions
CI proves."""

import importlib
import importlib.metadata
import re
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


# An assignment to, or a call that changes, the interpreter's module search path; in code and in
# code kept in strings (drivers written out by tests), in every language the repository holds.
PATH_EDIT = re.compile(r"\bsys\s*\.\s*path\s*(\.\s*(insert|append|extend|remove)\b|\[|\+?=(?!=))")
SKIPPED_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".pytest_cache"}


def test_nothing_edits_sys_path():
    """Scripts run from a bare checkout too: `python -m bench.<name>` and train.py, run from
    the root, find the package there; nothing needs a path edit."""
    files = [p for p in ROOT.rglob("*") if p.is_file() and p.suffix in {
        ".py", ".sh", ".md", ".sbatch", ".toml", ".yaml", ".cfg"}
        and not SKIPPED_DIRS & set(p.relative_to(ROOT).parts)]
    assert any(p.parts[-2:] == ("bench", "common.py") for p in files)  # the scan sees bench/
    edits = [f"{path.relative_to(ROOT)}:{n}" for path in files
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if PATH_EDIT.search(line)]
    assert not edits, f"sys.path edited in {edits}; install the package (pip install -e .)"
    name = "sys" + ".path"  # split, or this file would match itself
    assert PATH_EDIT.search(f"{name}.insert(0, root)") and PATH_EDIT.search(f"{name}[:0] = x")
    assert not PATH_EDIT.search(f"{name} == x")


def test_deepspeed_is_bounded_to_what_ci_proves():
    (spec,) = [Requirement(r) for r in PROJECT["dependencies"]
               if Requirement(r).name == "deepspeed"]
    assert any(s.operator == "<" for s in spec.specifier), spec  # an upper bound
    assert spec.specifier.contains(importlib.metadata.version("deepspeed")), spec
