"""Helpers for the SLURM tests: find a running cluster, submit, poll jobs, read metrics.

The tests use the one-node cluster of `slurm/ci_setup.sh` (its slurm.conf is found in
$MEGATRON_REMBERT_SLURM_DIR, default /tmp/megatron_rembert_slurm) or whatever $SLURM_CONF names.
Every wait polls with a deadline, so a stuck job fails the test instead of hanging CI.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Sequence length 32 as the test dataset; every step logged; no validation or periodic saves.
COMMON_OVERRIDES = ("data.seq_length=32", "train.log_interval=1", "train.eval_interval=0",
                    "train.save_interval=0")


def slurm_env() -> tuple[dict | None, str]:
    """(environment for SLURM commands, "") when a cluster answers, else (None, why not)."""
    if shutil.which("sbatch") is None:
        return None, "no sbatch on PATH (run `bash slurm/ci_setup.sh` for a local cluster)"
    env = dict(os.environ)
    if "SLURM_CONF" not in env:
        scratch = Path(os.environ.get("MEGATRON_REMBERT_SLURM_DIR", "/tmp/megatron_rembert_slurm"))
        if (scratch / "slurm.conf").is_file():
            env["SLURM_CONF"] = str(scratch / "slurm.conf")
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"sinfo failed ({err})"
    states = out.stdout.split()
    if out.returncode != 0 or not any(s in ("idle", "mix", "alloc") for s in states):
        said = out.stdout.strip() or out.stderr.strip()
        return None, f"no SLURM node accepts jobs (sinfo: {said}); run `bash slurm/ci_setup.sh`"
    return env, ""


def run(cmd: list[str], env: dict, **kwargs) -> str:
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
                         **kwargs)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr}")
    return out.stdout


def sbatch(args: list[str], env: dict) -> str:
    """Submit from the repository root (the scripts run there); return the job id."""
    return run(["sbatch", "--parsable", *args], env).strip().split(";")[0]


def job_info(job_id: str, env: dict) -> dict[str, str]:
    """scontrol's fields of a job ({} once SLURM has forgotten it)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return {}
    first = out.stdout.splitlines()[0] if out.stdout.strip() else ""
    return dict(re.findall(r"(\w+)=(\S*)", first))


def poll(condition, timeout: float, what: str, period: float = 0.5):
    """Call `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED")


def daemon_log_lines(job_id: str, env: dict, limit: int = 40) -> str:
    """The lines of slurmctld's and slurmd's logs that name the job (for failure messages)."""
    # "JobId=26", "batch job 26", "[26.batch]", "StepId=26.0"; not a timestamp's "[2026-".
    base = re.escape(job_id.split("_")[0])
    pattern = re.compile(rf"(JobId=|[Jj]ob ){base}\b|(StepId=|\[){base}\.")
    folder = Path(env.get("SLURM_CONF", "/nonexistent")).parent
    lines = []
    for name in ("slurmctld.log", "slurmd.log"):
        path = folder / name
        if path.is_file():
            lines += [f"{name}: {x}" for x in path.read_text(errors="replace").splitlines()
                      if pattern.search(x)]
    return "\n".join(lines[-limit:]) or f"(no daemon log lines for job {job_id} in {folder})"


def wait_job(job_id: str, env: dict, timeout: float, log: Path | None = None) -> dict:
    info = poll(lambda: (i := job_info(job_id, env)).get("JobState") in FINAL and i,
                timeout, f"job {job_id} to end")
    if info["JobState"] != "COMPLETED" or info.get("ExitCode") != "0:0":
        text = log.read_text() if log is not None and log.exists() else "(no log)"
        raise AssertionError(f"job {job_id} ended {info['JobState']} exit {info.get('ExitCode')}"
                             f" reason {info.get('Reason')}\n--- log:\n{text[-6000:]}"
                             f"\n--- daemons:\n{daemon_log_lines(job_id, env)}")
    return info


def cancel(job_ids: list[str], env: dict) -> None:
    """Remove the test's jobs, whatever state they are in (cleanup)."""
    if job_ids:
        subprocess.run(["scancel", *job_ids], env=env, capture_output=True, timeout=30)


def read_metrics(log_dir: Path, split: str = "train") -> list[dict]:
    path = log_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [x for x in lines if x.get("split") == split]


def assert_same_losses(got: list[dict], want: list[dict], rel: float = 1e-6) -> None:
    assert [x["step"] for x in got] == [x["step"] for x in want], (
        f"steps differ: {[x['step'] for x in got]} vs {[x['step'] for x in want]}")
    for a, b in zip(got, want, strict=True):
        for key in ("loss", "lr"):
            assert math.isclose(a[key], b[key], rel_tol=rel, abs_tol=0.0), (
                f"step {a['step']}: {key} {a[key]!r} vs reference {b[key]!r}")


def train_overrides(dataset: dict, steps: int, out: Path) -> list[str]:
    """train.py options for the tiny config on the test dataset, outputs under `out`."""
    sets = [f"data.path={dataset['data']}", f"data.tokenizer={dataset['tokenizer']}",
            f"train.steps={steps}",
            f"train.save_dir={out / 'checkpoints'}", f"train.log_dir={out / 'logs'}",
            *COMMON_OVERRIDES]
    return [arg for s in sets for arg in ("--set", s)]
