"""Tests of the bench package (`python -m bench.<name>`): `scripts()` lists its script modules
from the package's own files, `run_tiny` runs one at its smallest size (its TINY_ARGS)."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import bench

ROOT = Path(__file__).resolve().parents[2]


def scripts() -> list[str]:
    """The bench modules that are scripts (they have `main`), by name, from the package's
    files: a new script is listed without anyone adding it."""
    names = [info.name for info in pkgutil.iter_modules(bench.__path__)]
    return sorted(n for n in names if hasattr(importlib.import_module(f"bench.{n}"), "main"))


def tiny_command(name: str, tmp: Path) -> list[str]:
    """`python -m bench.<name>` with the module's TINY_ARGS ({tmp}: a scratch folder,
    {python}: this interpreter)."""
    module = importlib.import_module(f"bench.{name}")
    args = [a.format(tmp=tmp, python=sys.executable) for a in module.TINY_ARGS]
    return [sys.executable, "-m", f"bench.{name}", *args]


def run_tiny(name: str, tmp: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """The script's smallest run, from the repository root, as users start it."""
    return subprocess.run(tiny_command(name, tmp), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
