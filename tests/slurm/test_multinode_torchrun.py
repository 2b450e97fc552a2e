"""Two torchrun "nodes" (--nnodes 2, c10d rendezvous on 127.0.0.1, one rank each) train
exactly like one node with two ranks: the multi-node recipe of slurm/README.md, no SLURM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import free_port
from tests.slurm.cluster import REPO, assert_same_losses, read_metrics, train_overrides

pytestmark = pytest.mark.multiprocess  # every test here starts processes

STEPS = 8
TIMEOUT = 240


def torchrun(nnodes: int, nproc: int, port: int, args: list[str], log: Path):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
           f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=test-{port}", "--max-restarts=0",
           "train.py", "--config", "configs/tiny.yaml", *args]
    return subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)


def finish(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT)
    finally:
        for p in procs:  # a hung rendezvous must not outlive the test
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, f"{log}:\n{log.read_text()[-4000:]}"


def test_two_nodes_match_one_node(tiny_dataset, tmp_path):
    one, two = tmp_path / "one_node", tmp_path / "two_nodes"
    log = tmp_path / "one_node.log"
    finish([torchrun(1, 2, free_port(), train_overrides(tiny_dataset, STEPS, one), log)], [log])

    port = free_port()
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    finish([torchrun(2, 1, port, train_overrides(tiny_dataset, STEPS, two), lg) for lg in logs],
           logs)

    reference = read_metrics(one / "logs")
    assert [m["step"] for m in reference] == list(range(1, STEPS + 1))
    assert_same_losses(read_metrics(two / "logs"), reference)
    # One node hosted rank 0 (it prints the summary), the other rank 1.
    done = [f"done at step {STEPS}" in lg.read_text() for lg in logs]
    assert sorted(done) == [False, True], done
