"""slurm/pretrain.sbatch on a real (one-node) SLURM cluster, tiny model on CPU, 2 ranks.

1. A job trains to the end: losses logged for every step, final checkpoint complete.
2. A job sent USR1 mid-run (what SLURM sends before the time limit) checkpoints, requeues
   itself, resumes, and ends with exactly the losses of the uninterrupted job of test 1.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import pytest

from tests.slurm.cluster import (
    assert_same_losses,
    cancel,
    job_info,
    poll,
    read_metrics,
    run,
    sbatch,
    train_overrides,
    wait_job,
)

pytestmark = pytest.mark.multiprocess  # every test here starts processes

STEPS = 50
JOB_TIMEOUT = 240  # seconds; a run takes ~30 s of start-up and a few seconds of steps


@pytest.fixture(scope="module")
def jobs(slurm):
    """Job ids submitted by this module; all cancelled at the end, whatever happened."""
    ids: list[str] = []
    yield ids
    cancel(ids, slurm)


def submit(slurm: dict, jobs: list[str], dataset: dict, out: Path) -> tuple[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    env = {**slurm, "NPROC_PER_NODE": "2"}
    job = sbatch(["--gpus-per-node=0", "--time=10", f"--output={out}/job-%j.out",
                  "slurm/pretrain.sbatch", "configs/tiny.yaml",
                  *train_overrides(dataset, STEPS, out)], env)
    jobs.append(job)
    return job, out / f"job-{job}.out"


@pytest.fixture(scope="module")
def reference(slurm, jobs, tiny_dataset, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("uninterrupted")
    job, log = submit(slurm, jobs, tiny_dataset, out)
    info = wait_job(job, slurm, JOB_TIMEOUT, log)
    return {"job": job, "info": info, "out": out, "log": log,
            "metrics": read_metrics(out / "logs")}


def test_job_trains_to_the_end(reference):
    out, metrics = reference["out"], reference["metrics"]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(math.isfinite(m["loss"]) for m in metrics)
    # Learning, not just running: the tiny model's loss falls well below its start (~6.9).
    first = sum(m["loss"] for m in metrics[:5]) / 5
    last = sum(m["loss"] for m in metrics[-5:]) / 5
    assert last < first - 0.3, f"loss did not fall: first steps {first:.3f}, last {last:.3f}"
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{STEPS:08d}"
    assert (out / "checkpoints" / latest / "complete").is_file()
    text = reference["log"].read_text()
    assert "training finished" in text and "requeueing" not in text
    assert reference["info"]["Restarts"] == "0"
    assert sorted(p.name for p in out.glob("job-*.out")) == [reference["log"].name]


def test_signalled_job_checkpoints_requeues_and_resumes(slurm, jobs, tiny_dataset, reference,
                                                        tmp_path):
    job, log = submit(slurm, jobs, tiny_dataset, tmp_path)
    # Signal once a few steps are logged, i.e. in the middle of training.
    poll(lambda: len(read_metrics(tmp_path / "logs")) >= 3, JOB_TIMEOUT, "the first steps")
    run(["scancel", "--signal=USR1", "--batch", job], slurm)
    # SLURM holds a requeued job for about two minutes before it may start again; release it
    # rather than wait, but not within the second of the requeue: slurmd revoked the first run's
    # credential then, compares times in whole seconds, and refuses (the job FAILS, exit 1) a
    # launch whose credential is not newer ("Job N already killed, do not launch batch job").
    # (On its way back, the job passes through states such as CANCELLED with Restarts=1.)
    poll(lambda: (i := job_info(job, slurm)).get("Restarts") == "1"
         and i.get("JobState") == "PENDING", JOB_TIMEOUT, "the requeued job in the queue")
    time.sleep(2.0)
    run(["scontrol", "update", f"JobId={job}", "StartTime=now"], slurm)
    info = wait_job(job, slurm, JOB_TIMEOUT, log)
    assert info["Restarts"] == "1", info

    text = log.read_text()
    assert "requeueing job" in text, text[-3000:]
    saved = int(re.search(r"checkpoint at step (\d+) of \d+; requeueing", text).group(1))
    assert 3 <= saved < STEPS, f"the signal should stop training mid-run; saved at {saved}"
    assert f"resumed from {tmp_path / 'checkpoints' / f'step_{saved:08d}'}" in text
    assert "training finished" in text
    # Every step logged once across both runs, with the uninterrupted job's losses.
    assert_same_losses(read_metrics(tmp_path / "logs"), reference["metrics"])
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:08d}"
