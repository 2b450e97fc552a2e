"""bench.pipeline_balance on CPU: the stages it times are the partitions the trainer and
earlier versions build, and a stage's time is the sum of its layers' times."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_table, pipeline_balance
from megatron_rembert.checkpoint.resume import parameter_balanced_boundaries
from megatron_rembert.run_config.load import load_config
from megatron_rembert.training.plan import RunPlan

ROOT = Path(__file__).resolve().parents[2]


def test_stage_times_sum_their_layers():
    assert pipeline_balance.stages([0, 2, 5], [1.0, 2.0, 3.0, 4.0, 5.0]) == [3.0, 12.0]
    assert pipeline_balance.stages([0, 1, 2], [7.0, 8.0]) == [7.0, 8.0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16: with the trainer's main gradients
def test_runs_and_times_both_partitions(dtype, tmp_path):
    sets = ["model.preset=rembert", "model.num_hidden_layers=6", "model.vocab_size=32000",
            "data.seq_length=64", "train.micro_batch_size=2", "parallel.tp=1"]
    figures = tmp_path / "parts.json"
    run = subprocess.run([sys.executable, "-m", "bench.pipeline_balance", "--device", "cpu",
                          "--dtype", dtype, "--pp", "2", "--repeats", "1", "--preset",
                          "rembert", *[a for s in sets[1:] for a in ("--set", s)],
                          "--json", str(figures)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split()[1]: line.split()[2] for line in run.stdout.splitlines()
            if line.strip().startswith("2 ")}
    config = load_config(ROOT / "configs" / "rembert.yaml", [*sets, "parallel.pp=2"])
    for name, bounds in (("flops", RunPlan.build(config, 2).stage_boundaries),
                         ("params", parameter_balanced_boundaries(config, 2))):
        assert rows[name] == f"{bounds[1] - bounds[0]}/{bounds[2] - bounds[1]}", run.stdout
    assert "flops-balanced / parameter-balanced tokens/s" in run.stdout
    parts = json.loads(figures.read_text())
    assert parts.keys() == gpu_table.SCHEMA["parts"]
    assert all(ms > 0 for ms in parts.values())
