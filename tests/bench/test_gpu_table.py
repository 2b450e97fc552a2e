"""bench/gpu_checks.sh's one table: the engine bench writes its figures (--json) in the shape
bench.gpu_table reads (the other benches' tests check their files against gpu_table.SCHEMA),
and the table judges every goal from a full set of files."""

import json

import pytest

from bench import gpu_table
from tests.bench import run_tiny

STEP = {"tokens_per_s": 1e5, "tflops": 450.0, "mfu": 0.455, "memory_gib": 15.0}


@pytest.mark.multiprocess
def test_engine_bench_writes_what_the_table_reads(tmp_path):
    """The trainer against the bare model on CPU (tiny preset, gas 1 and 2): the bench's tiny
    run."""
    run = run_tiny("train_throughput", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = tmp_path / "engine.json"
    engine = json.loads(figures.read_text())
    assert engine.keys() == gpu_table.SCHEMA["engine"]
    assert engine["sync_debug"] is None  # the sync check runs on CUDA only
    assert [r["gas"] for r in engine["rows"]] == [1, 2]
    for row in engine["rows"]:
        assert gpu_table.ENGINE_ROW <= row.keys() and row["wrapper"] == "DistributedOptimizer"
        assert row["trainer_metrics"].keys() == gpu_table.STEP
    rows = {r[0]: r for r in gpu_table.rows(tmp_path)}
    assert "trainer / bare model + fused AdamW, gas 2" in rows
    assert rows["model step bf16"][1] == "not measured"  # no model.json in this folder


def test_the_table_judges_every_goal(tmp_path):
    files = {
        "model": {"variants": {"flash": STEP, "masked": {**STEP, "mfu": 0.40}}, "best": "flash"},
        "engine": {"rows": [{"gas": g, "bare": 1.0, "trainer": t, "optimizer": 0.01,
                             "trainer_metrics": {**STEP, "mfu": mfu}}
                            for g, t, mfu in ((1, 1.2, 0.40), (8, 1.04, 0.44))],
                   "sync_debug": "clean"},
        "parts": {"embedding_ms": 0.25, "layer_ms": 2.0, "head_ms": 5.0},
        "layer": {"eager_ms": 2.4, "compiled_ms": 2.0, "matmuls_ms": 1.6, "speedup": 1.2},
        "head": {"best": {"setting": "rows default, keep 1 GiB", "ms": 5.2, "extra_gib": 1.4},
                 "layer_ms": 2.1},
        "fp8": {"fp8_over_bf16": 1.2, "fp8_tokens_per_s": 1.2e5, "fp8_mfu": None,
                "loss_ratio": 1.01},
    }
    assert files.keys() == gpu_table.SCHEMA.keys()
    for name, figures in files.items():
        assert figures.keys() == gpu_table.SCHEMA[name], name
        (tmp_path / f"{name}.json").write_text(json.dumps(figures))
    met = {r[0]: r[3] for r in gpu_table.rows(tmp_path)}
    assert "not measured" not in json.dumps(gpu_table.rows(tmp_path))
    assert met["model step bf16, flash"] == "yes"  # 45.5% >= 45%
    assert met["trainer step bf16, gas 8"] == "yes"  # 44% >= 43%
    assert met["trainer / bare model + fused AdamW, gas 1"] == "NO"  # 1 / 1.2 < 0.9
    assert met["trainer / bare model + fused AdamW, gas 8"] == "yes"  # 1 / 1.04 >= 0.95
    assert met["host syncs in a micro-batch (sync_debug_mode error)"] == "yes"
    assert met["model step fp8 / bf16 tokens/s"] == "NO"  # 1.2x < 1.25x
    assert met["embedding fwd + bwd (into fp32 main grads)"] == "yes"  # 0.25 ms
    assert met["MLM head + loss fwd + bwd (rows default, keep 1 GiB)"] == "NO"  # 2.6 layers
