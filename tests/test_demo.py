"""The README's demo command runs end to end (shortened with --quick) and the loss falls."""

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_quick(tmp_path):
    env = {**os.environ, "DEMO_OUT": str(tmp_path / "demo")}
    run = subprocess.run(["bash", "demo.sh", "--quick"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "TensorBoard" in run.stdout and "checkpoints" in run.stdout
    rows = [json.loads(line) for line in
            (tmp_path / "demo" / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in rows if r["split"] == "train"]
    assert len(train) == 8 and train[-1] < train[0] - 0.5
    assert (tmp_path / "demo" / "checkpoints" / "latest").read_text().strip() == "step_00000040"
