"""Failures of the machine or of a peer during a real run of train.py (issue 30, "one error
line from every failure"): each row starts the ranks as the launcher would (one process each,
torchrun's variables), breaks something, and asserts that every rank still alive exits
non-zero with exactly one `error:` line naming the file, key or position, no traceback, and
that nothing outside the run's folder changed.

The bad settings and files refused before a run starts are tests/test_bad_input_table.py."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.distributed import free_port
from tests.training.production import as_sets, data_overrides

ROOT = Path(__file__).resolve().parents[2]
FAILING_TRAIN = str(Path(__file__).with_name("failing_train.py"))
TIMEOUT_MIN = 0.25  # 15 s: a frozen peer is given up on quickly


@dataclass
class Row:
    id: str
    ranks: int
    names: list[str]  # what each rank's error line must contain ({run}: the run's folder)
    failure: str = ""  # failing_train.py's FAILURE; "" = plain train.py
    failing_rank: int = 0
    act: str = ""  # "kill" or "stop": done to rank 1 once rank 0 has logged step 2
    sets: dict = field(default_factory=dict)
    per_rank: dict = field(default_factory=dict)  # rank -> names for that rank instead


COLLECTIVE = "when a collective failed: a peer rank died, froze or stopped on its own error"
ROWS = [
    Row("checkpoint-disk-full", 2, ["{run}/ckpt/step_00000002", "saving failed on 1 rank(s)",
                                    "still names the last good checkpoint"],
        failure="checkpoint-disk-full", failing_rank=1),
    # Our optimizer's shard file, half written on rank 1 (the production path)
    Row("optimizer-shard-disk-full", 2, ["{run}/ckpt/step_00000002", "saving failed on 1 rank(s)",
                                         "still names the last good checkpoint"],
        failure="optimizer-shard-disk-full", failing_rank=1,
        per_rank={1: ["{run}/ckpt/step_00000002: saving failed on 1 rank(s)",
                      "No space left on device"]}),
    Row("metrics-disk-full-and-its-peer", 2, [], failure="metrics-disk-full",
        per_rank={0: ["{run}/logs/metrics.jsonl", "No space left on device", "GiB free"],
                  1: ["rank 1 was at step", COLLECTIVE]}),
    # Rank 0 alone rolls back (train.resume_from) and refuses a folder that is not there;
    # rank 1, waiting for it, names its own position, not a traceback.
    Row("peer-refused", 2, [], sets={"train.resume_from": "{run}/ckpt/step_00000005"},
        per_rank={0: ["{run}/ckpt/step_00000005: no such folder"],
                  1: ["rank 1 was at step 0, start-up", COLLECTIVE]}),
    Row("peer-killed", 2, ["rank 0 was at step", COLLECTIVE], act="kill",
        sets={"train.steps": 10_000}),
    Row("peer-frozen", 2, [COLLECTIVE], act="stop",
        sets={"train.steps": 10_000, "parallel.timeout_minutes": TIMEOUT_MIN},
        per_rank={0: ["rank 0 was at step", COLLECTIVE, "parallel.timeout_minutes=0.25"],
                  1: ["rank 1 was at step", COLLECTIVE]}),
    # (A hand-edited meta.json is tests/test_bad_input_table.py's "meta-json-edited", read
    # by the same find_latest as a resume; tests/checkpoint/test_step_folder.py calls it.)
]


def _tree_hashes(*folders: Path, skip: Path) -> dict[str, str]:
    out = {}
    for folder in folders:
        for p in sorted(folder.rglob("*")):
            if p.is_file() and skip not in p.parents:
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _wait_for(path: Path, text: str, procs: list[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.5)
    raise AssertionError(f"never saw {text!r} in {path}: {path.read_text()[-2000:]}")


def _launch(row: Row, sets: dict, out: Path) -> tuple[list[subprocess.Popen], list[Path]]:
    args = [a for s in as_sets(sets) for a in ("--set", s)]
    program = FAILING_TRAIN if row.failure else "train.py"
    port = str(free_port())
    procs, logs = [], []
    for rank in range(row.ranks):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "RANK": str(rank), "WORLD_SIZE": str(row.ranks), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(row.ranks), "FAILURE": row.failure,
               "FAILING_RANK": str(row.failing_rank)}
        stdout, stderr = out / f"rank{rank}.out", out / f"rank{rank}.err"
        with open(stdout, "w") as o, open(stderr, "w") as e:
            procs.append(subprocess.Popen(
                [sys.executable, program, "--config", "configs/tiny.yaml", *args],
                cwd=ROOT, env=env, stdout=o, stderr=e))
        logs.append(stderr)
    return procs, logs


@pytest.mark.multiprocess
@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_failure_is_one_error_line_per_rank(row, tiny_dataset, tmp_path):
    run, neighbours, out = tmp_path / "run", tmp_path / "neighbours", tmp_path / "output"
    out.mkdir()
    neighbours.mkdir()
    (neighbours / "other_run_file").write_text("not to be touched")
    sets = {**data_overrides(*tiny_dataset, run, 2),
            **{k: str(v).format(run=run) for k, v in row.sets.items()}}
    before = _tree_hashes(tiny_dataset[0], tiny_dataset[1].parent, tmp_path, skip=run)
    procs, logs = _launch(row, sets, out)
    try:
        if row.act:
            _wait_for(out / "rank0.out", "step       2/", procs, 240)
            os.kill(procs[1].pid, signal.SIGKILL if row.act == "kill" else signal.SIGSTOP)
            if row.act == "stop":  # rank 0 gives up on it; then it runs on into the break
                procs[0].wait(timeout=240)
                os.kill(procs[1].pid, signal.SIGCONT)
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    alive = [r for r in range(row.ranks) if not (row.act == "kill" and r == 1)]
    for rank in alive:
        err = logs[rank].read_text()
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert codes[rank] != 0, f"rank {rank}: {err[-3000:]}"
        assert len(lines) == 1 and "Traceback" not in err, f"rank {rank}: {err[-3000:]}"
        for name in row.per_rank.get(rank, row.names):
            assert name.format(run=run) in lines[0], (name, lines[0])
    after = _tree_hashes(tiny_dataset[0], tiny_dataset[1].parent, tmp_path, skip=run)
    assert {k: v for k, v in after.items() if not k.startswith(str(out))} == \
        {k: v for k, v in before.items() if not k.startswith(str(out))}
    if "disk-full" in row.failure and "metrics" not in row.failure:  # nothing left behind
        assert not (run / "ckpt" / "latest").exists()
        assert not list((run / "ckpt").glob("step_*"))
