"""The loader's workers leave the stop signals to their rank; the rank's pool ends them
(SIGKILL), and they end with their rank (data/loader.py).

torchrun signals a rank's whole process group and a scheduler every process of a job, so the
workers receive the stop signals too. A worker killed while it waited for a task died holding
the pool's task-queue lock: the rank then waited for that lock for ever when it closed the
loader after its stop save (issue 30). Each test runs a small loader in a process of its own
(the rank) and signals its workers from this process, as torchrun or a scheduler would; a
hang fails the test through the subprocess timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]

# make(j) = str(j): batches are their numbers. The rank prints its workers' pids, waits for
# a line on stdin (the signals are sent meanwhile), then takes 12 batches and closes.
SURVIVES = """
import multiprocessing, sys
from multiprocessing import resource_tracker
from megatron_rembert.data.loader import iterate_batches

batches = iterate_batches(str, num_workers=2, prefetch=2, return_tensors="np")
first = next(batches)
print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
print(resource_tracker._resource_tracker._pid, flush=True)
sys.stdin.readline()
print(first, *(next(batches) for _ in range(12)), flush=True)
batches.close()
print("closed", flush=True)
"""

# make(j) = time.sleep(j): after batch 0 every worker is busy sleeping for seconds; closing
# must end them at once, although they ignore SIGTERM, not wait for the sleeps and then for
# the task-queue lock that Pool.terminate() holds.
BUSY = """
import time
from megatron_rembert.data.loader import iterate_batches

batches = iterate_batches(time.sleep, num_workers=2, prefetch=2, return_tensors="np")
next(batches)
batches.close()
print("closed", flush=True)
"""


def _rank(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_workers_survive_stop_signals_from_outside_and_the_rank_closes_them():
    # multiprocessing's resource tracker, also in the rank's process group, is signalled as
    # well: killed by SIGUSR1, it was relaunched without its records and printed a KeyError
    # traceback for each of the pool's semaphores when the rank closed the loader.
    rank = _rank(SURVIVES)
    workers = [int(pid) for pid in rank.stdout.readline().split()]
    tracker = int(rank.stdout.readline())
    assert len(workers) == 2
    for pid in [*workers, tracker]:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            os.kill(pid, sig)
    out, err = rank.communicate("go\n", timeout=120)
    assert rank.returncode == 0, err
    assert out.split() == [str(j) for j in range(13)] + ["closed"], err
    assert "Traceback" not in err and "resource_tracker" not in err, err


def test_closing_ends_busy_workers_at_once():
    rank = _rank(BUSY)
    out, err = rank.communicate(timeout=120)
    assert rank.returncode == 0 and out.split() == ["closed"], err


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_workers_leave_with_a_killed_rank():
    # Immune to SIGTERM, workers must still not outlive their rank when it is killed with -9
    # (the OOM killer, a launcher's last resort): they leave at the end of their task queue.
    rank = _rank(SURVIVES)
    workers = [int(pid) for pid in rank.stdout.readline().split()]
    assert len(workers) == 2 and not any(_gone(pid) for pid in workers)
    rank.kill()
    rank.communicate(timeout=60)
    deadline = time.monotonic() + 60  # a bound on waiting for ever, not a timing
    while not all(_gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_gone(pid) for pid in workers)
