"""bench/gpu_train_checks.py, the training part of the GPU acceptance script, run on CPU:
the same train.py launches, signal, resume and comparisons, with gloo instead of NCCL."""

import pytest

from tests.bench import run_tiny

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def test_gpu_train_checks_pass_on_cpu(tmp_path):
    """Its tiny run: 8 steps, the signal after step 2, no loader workers."""
    run = run_tiny("gpu_train_checks", tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    passed = [line for line in run.stdout.splitlines() if line.startswith("PASS")]
    assert len(passed) == 4, run.stdout
