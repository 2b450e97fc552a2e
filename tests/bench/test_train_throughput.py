"""The GPU branches of the benchmarks, run on CPU with only torch and triton importable."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]

# Import the benchmark modules as a bare GPU image would: without the training stack.
SCRIPT = """
import importlib.abc, json, sys

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"deepspeed", "transformers", "yaml", "safetensors",
                                  "sentencepiece", "pyarrow"}:
            raise ImportError(f"{name} is not installed on this image")

sys.meta_path.insert(0, Missing())
import torch

import bench.fp8_gpu, bench.kernels_gpu, bench.layer_fusion
from bench import train_throughput as bench
result = bench.preset_throughput("tiny", batch=2, seq=32, steps=2, device=torch.device("cpu"))
print(json.dumps(result))
"""


def test_gpu_branch_runs_without_the_training_stack():
    import json

    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["tokens_per_s"] > 0 and result["tflops"] > 0
    assert result["mfu"] is None  # no peak FLOP/s for a CPU
    assert result["memory_gib"] > 0


def test_trainer_branch_runs_on_cpu():
    """--trainer's measurement (the DeepSpeed step, bf16, accumulation) on
    the tiny preset, on CPU with gloo."""
    import json

    code = ("import json\n"
            "from bench import train_throughput as tt\n"
            "from megatron_rembert.train import end_process_groups, exit_now\n"
            "print(json.dumps(tt.trainer_throughput('tiny', micro=2, gas=2, seq=32, steps=2)))\n"
            "end_process_groups()\n"
            "exit_now(0)\n")  # as the bench's main ends
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["tokens_per_s"] > 0 and result["mfu"] is None
    assert set(result["estimate_gib"]) == {"parameters", "gradients", "optimizer_states",
                                           "optimizer_step", "transient_copy", "activations"}
