"""bench.layer_fusion on CPU at the tiny preset, with dropout and a key mask: it runs, finds
the compiled layers equal to the eager ones (the same dropout masks), one graph for both
layers and no graph break (no timing is checked)."""

import json
import re

import pytest

from bench import gpu_table
from tests.bench import run_tiny

pytestmark = pytest.mark.multiprocess  # every test spawns processes


def test_layer_fusion_bench_runs_on_cpu(tmp_path):
    """Its tiny run: tiny preset, 2 layers of 2 x 16 tokens, a key mask, dropout 0.1."""
    run = run_tiny("layer_fusion", tmp_path)  # exits 1 if the paths differ or a graph broke
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "compiled: 1 graph(s) for 2 layer(s), 0 graph break(s)" in run.stdout
    assert "(ok, limit 0.0001)" in run.stdout
    rows = dict(re.findall(r"^(eager|compiled|matmuls) +([0-9.]+) ", run.stdout, re.MULTILINE))
    assert rows.keys() == {"eager", "compiled", "matmuls"}
    assert all(float(ms) > 0 for ms in rows.values())  # ms per layer
    figures = json.loads((tmp_path / "layer.json").read_text())
    assert figures.keys() == gpu_table.SCHEMA["layer"]
