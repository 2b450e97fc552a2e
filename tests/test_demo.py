"""The README's demo command runs end to end (shortened with --quick) and the loss falls; run
again, it says each stage is done and prints the same summary, with the files untouched."""

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts processes

ROOT = Path(__file__).resolve().parents[1]


def _demo(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEMO_OUT": str(out)}
    return subprocess.run(["bash", "demo.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


def _summary(stdout: str) -> str:
    return stdout[stdout.index("\ntraining loss"):]


def test_demo_quick_twice(tmp_path):
    out = tmp_path / "demo"
    run = _demo(out, "--quick")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "TensorBoard" in run.stdout and "checkpoints" in run.stdout
    assert "training SentencePiece" in run.stdout  # progress of the long stages
    assert "| elapsed 0:0" in run.stdout and "| eta 0:0" in run.stdout
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in rows if r["split"] == "train"]
    assert len(train) == 8 and train[-1] < train[0] - 0.5
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000040"

    model = (out / "tokenizer" / "spm.model").read_bytes()
    again = _demo(out, "--quick")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    for stage in ("corpus: already done", "already done: ", "training: already done"):
        assert stage in again.stdout
    assert _summary(again.stdout) == _summary(run.stdout)
    assert (out / "tokenizer" / "spm.model").read_bytes() == model

    full = _demo(out)  # another mode into the same folder: refused before any stage runs
    assert full.returncode == 2 and "holds a quick demo" in full.stderr
    assert (out / "demo_mode").read_text().strip() == "quick"
