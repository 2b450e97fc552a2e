"""train.py end to end, one process: train.max_minutes saves and exits 0 with `latest` on the
saved step, and the resumed run continues; the start-up prints its stages and no DeepSpeed
chatter; every logged step's FLOPs count its real masked tokens under a changing mask rate
(checked against the matmuls of the model, torch's FlopCounterMode); the end prints and logs
the run's average throughput without the first step.

The limit is a tiny fraction of a minute (6 ms), passed before the first step ends: the stop
after step 1 is certain, no timing is asserted (the start-up total is only held within the
process's life as the test clocked it: counted from a start before the process's own, it
would exceed it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import free_port
from tests.training.conftest import SEQ

pytestmark = pytest.mark.multiprocess  # starts train.py (and its loader worker)

ROOT = Path(__file__).resolve().parents[2]
BATCH = 8
VOCAB = 1024  # the dataset's 1000 pieces, padded by the model to 1024 anyway: no padding rows
# The mask rate falls from 0.3 to 0.1 over the first half, then stays at 0.1.
SCHEDULE = {"data.phase_starts": "[0.0, 0.5]", "data.phase_mask_prob": "[0.3, 0.1]",
            "data.mask_schedule": "linear"}
STARTUP_STAGES = ["settings", "training imports", "rendezvous", "data checks", "model",
                  "engine", "resume", "loader"]


def _train(run: Path, tiny_dataset, **extra) -> subprocess.CompletedProcess:
    data, tokenizer = tiny_dataset
    values = {"data.path": data, "data.tokenizer": tokenizer, "data.seq_length": SEQ,
              "data.num_workers": 0, "data.allow_larger_vocab": "true",
              "model.vocab_size": VOCAB, "train.steps": 4,
              "train.global_batch_size": BATCH, "train.micro_batch_size": 4,
              "train.log_interval": 1, "train.eval_interval": 0, "train.save_interval": 0,
              "train.save_dir": run / "ckpt", "train.log_dir": run / "logs", **SCHEDULE,
              **extra}
    args = [sys.executable, "train.py", "--config", "configs/tiny.yaml"]
    for key, value in values.items():
        args += ["--set", f"{key}={value}"]
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**env, "MASTER_PORT": str(free_port())})


def _rows(run: Path, split: str) -> dict[int, dict]:
    rows = map(json.loads, (run / "logs" / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in rows if r["split"] == split}


def _matmul_flops(sequences: int, rows: int) -> int:
    """Forward and backward FLOPs of the tiny model's matmuls on `sequences` rows of SEQ
    tokens with `rows` real masked slots each (FlopCounterMode). Attention as explicit matmuls
    (fused_softmax: the CPU's fused SDPA kernel escapes the counter; the same products)."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_rembert.config import get_preset
    from megatron_rembert.model.rembert import RemBertForPreTraining

    config = get_preset("tiny").replace(vocab_size=VOCAB, attention_backend="fused_softmax",
                                        loss_backend="reference")
    model = RemBertForPreTraining(config)
    ids = torch.randint(5, VOCAB, (sequences, SEQ))
    positions = torch.stack([torch.randperm(SEQ)[:rows] for _ in range(sequences)])
    with FlopCounterMode(display=False) as counter:
        out = model(ids, torch.ones_like(ids), torch.zeros_like(ids), positions,
                    torch.randint(0, VOCAB, (sequences, rows)), torch.ones(sequences, rows))
        out.loss_sum.backward()
    return counter.get_total_flops()


def test_time_limit_stops_cleanly_and_the_resumed_run_logs_true_flops(tmp_path, tiny_dataset):
    run = tmp_path / "run"
    launched = time.monotonic()
    first = _train(run, tiny_dataset, **{"train.max_minutes": 0.0001})
    wall = time.monotonic() - launched
    said = first.stdout + first.stderr
    assert first.returncode == 0, said
    assert "time limit reached (train.max_minutes=0.0001): saved step 1" in first.stdout
    assert (run / "ckpt" / "latest").read_text().strip() == "step_00000001"
    assert sorted(_rows(run, "train")) == [1]
    assert "done at step" not in first.stdout  # a stopped run does not report the end
    # start-up: every stage on its own line, in order, before the first step
    lines = first.stdout.splitlines()
    stages = [line.split(": ", 1)[1].rsplit(" ", 2)[0] for line in lines
              if line.startswith("start-up: ") and not line.startswith("start-up: done")]
    assert stages == STARTUP_STAGES
    done = next(x for x in lines if x.startswith("start-up: done"))
    assert lines.index(done) < lines.index(next(x for x in lines if x.startswith("step ")))
    # the stages' times add up to the total, which counts from the process's start: within
    # the process's life as this test clocked it (each printed to 0.1 s)
    seconds = [float(line.rsplit(" ", 2)[1]) for line in lines
               if line.startswith("start-up: ") and line != done]
    total = float(done.split("done in ", 1)[1].split(" s ", 1)[0])
    assert abs(sum(seconds) - total) <= 0.05 * (len(seconds) + 1), (seconds, total)
    assert 0 < total <= wall, (total, wall)
    # no routine DeepSpeed chatter
    assert "Setting accelerator to CPU" not in said and "built successfully" not in said
    # one step in this process: no average without the warm-up step
    assert "run average: needs two steps" in first.stdout

    second = _train(run, tiny_dataset)  # no limit: resumes at step 1 and finishes
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from" in second.stdout and "done at step 4" in second.stdout
    assert (run / "ckpt" / "latest").read_text().strip() == "step_00000004"
    rows = _rows(run, "train")
    assert sorted(rows) == [1, 2, 3, 4]

    # FLOPs: the model's body per sequence and its head per masked token, measured.
    one, two = _matmul_flops(BATCH, 1), _matmul_flops(BATCH, 2)
    head_per_token = (two - one) / BATCH
    body = one - BATCH * head_per_token
    masked = [rows[s]["masked_tokens"] for s in (2, 3, 4)]
    assert len(set(masked)) > 1  # the schedule changed the rate within the run
    for step in (1, 2, 3, 4):
        expected = body + rows[step]["masked_tokens"] * head_per_token
        assert rows[step]["flops"] == pytest.approx(expected, rel=1e-9), step

    # The run's average: steps 3 and 4 (step 2, this process's first, is the warm-up).
    average = _rows(run, "run_average")[4]
    assert average["steps"] == 2 and average["first_step"] == 3
    seconds = [BATCH * SEQ / rows[s]["tokens_per_s"] for s in (3, 4)]
    assert average["tokens_per_s"] == pytest.approx(2 * BATCH * SEQ / sum(seconds))
    assert average["tflops_per_gpu"] == pytest.approx(
        (rows[3]["flops"] + rows[4]["flops"]) / sum(seconds) / 1e12)
    assert "run average over steps 3-4 (the first step, the warm-up, left out)" in \
        second.stdout
