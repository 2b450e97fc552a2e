"""Every script of the bench package runs at its smallest size (TINY_ARGS) and exits 0, so a
broken bench fails CI; a script that needs CUDA refuses with one `error:` line where there is
none. The list comes from the package's files (tests/bench/__init__.py), not from here."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from tests.bench import run_tiny, scripts

pytestmark = pytest.mark.multiprocess  # each script runs as a process

# Scripts whose tiny run another test makes (run_tiny) and checks its figures: not run twice.
# test_the_scripts_run_elsewhere_really_are keeps this true.
RUN_ELSEWHERE = {"full_scale": "test_full_scale.py", "gpu_train_checks": "test_gpu_train_checks.py",
                 "layer_fusion": "test_layer_fusion.py", "train_throughput": "test_gpu_table.py"}


def test_the_package_has_its_scripts():
    names = scripts()
    assert {"data_throughput", "kernels_gpu", "memwatch", "gpu_table"} <= set(names)
    assert "common" not in names  # helpers, not a script
    for name in names:
        module = importlib.import_module(f"bench.{name}")
        assert isinstance(getattr(module, "TINY_ARGS", None), list), (
            f"bench/{name}.py: give it TINY_ARGS, the arguments of a run of seconds")


@pytest.mark.parametrize("name", [n for n in scripts() if n not in RUN_ELSEWHERE])
def test_every_bench_runs_at_a_tiny_size(name, tmp_path):
    run = run_tiny(name, tmp_path)
    output = run.stdout[-3000:] + run.stderr[-3000:]
    if getattr(importlib.import_module(f"bench.{name}"), "NEEDS_CUDA", False) and \
            not torch.cuda.is_available():
        assert run.returncode == 1, output
        assert run.stdout == "" and "Traceback" not in run.stderr, output
        assert run.stderr.startswith(f"error: bench.{name} needs a CUDA GPU"), output
        return
    assert run.returncode == 0, output
    assert "Traceback" not in run.stderr, output


def test_the_scripts_run_elsewhere_really_are():
    for name, test_file in RUN_ELSEWHERE.items():
        assert name in scripts()
        assert f'run_tiny("{name}"' in (Path(__file__).parent / test_file).read_text(), name
