"""bench/gpu_train_checks.py, the training part of the GPU acceptance script, run on CPU:
the same train.py launches, signal, resume and comparisons, with gloo instead of NCCL."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_train_checks_pass_on_cpu(tmp_path):
    run = subprocess.run([sys.executable, "bench/gpu_train_checks.py", "--steps", "8",
                          "--signal-at", "2", "--workers", "0", "--work", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    passed = [line for line in run.stdout.splitlines() if line.startswith("PASS")]
    assert len(passed) == 4, run.stdout
