"""Tests of the bench/ scripts, which are files to run, not a package: `bench_script` loads one
by its path."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_script(name: str) -> ModuleType:
    """bench/<name>.py as a module (registered in sys.modules, as an import would)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
