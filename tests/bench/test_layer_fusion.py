"""bench/layer_fusion.py on CPU at the tiny preset, with dropout and a key mask: it runs, finds
the compiled layers equal to the eager ones (the same dropout masks), one graph for both
layers and no graph break (no timing is checked)."""

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.bench import bench_script

pytestmark = pytest.mark.multiprocess  # every test spawns processes

ROOT = Path(__file__).resolve().parents[2]


def test_layer_fusion_bench_runs_on_cpu(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("layer_fusion", ROOT / "bench" /
                                                  "layer_fusion.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    figures = tmp_path / "layer.json"
    args = argparse.Namespace(preset="tiny", batch=2, seq=16, dtype="fp32", layers=2, iters=1,
                              masked=True, dropout="0.1", attention_backend="sdpa", cpu=True,
                              json=str(figures))
    torch._dynamo.reset()  # count this run's graphs, not a cache an earlier test filled
    results = bench.run(args)  # exits 1 if compiled and eager differ or a graph broke
    out = capsys.readouterr().out
    assert "compiled: 1 graph(s) for 2 layer(s), 0 graph break(s)" in out
    assert "(ok, limit 0.0001)" in out
    ms = results["sdpa", 0.1]
    assert ms.keys() == {"eager", "compiled", "matmuls"} and all(t > 0 for t in ms.values())
    assert json.loads(figures.read_text()).keys() == bench_script("gpu_table").SCHEMA["layer"]
