"""The GPU branch of bench/train_throughput.py, run on CPU with the tiny preset."""

import importlib.util
import math
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "train_throughput.py"


def test_preset_throughput_runs_and_reports():
    spec = importlib.util.spec_from_file_location("train_throughput", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.preset_throughput("tiny", batch=2, seq=32, steps=2,
                                     device=torch.device("cpu"))
    assert result["tokens_per_s"] > 0 and math.isfinite(result["tokens_per_s"])
    assert result["tflops"] > 0
    assert result["mfu"] is None  # no peak FLOP/s for a CPU
    assert result["memory_gib"] > 0
