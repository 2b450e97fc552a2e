"""Where this rank is, so that a hang is reported with each rank's position, not waited out.

The loop and the engine update `POSITION` (step, phase, micro-batch or pipeline instruction).
Two ways a hang surfaces:
- a collective times out and raises (gloo; NCCL with blocking wait): the loop re-raises it as an
  error that names the rank and its position (`describe`);
- NCCL's watchdog tears the process down without a Python exception: `Watchdog`, a daemon
  thread, prints the position to stderr once nothing has moved for 90% of the timeout.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from dataclasses import dataclass

from megatron_rembert.errors import UserError


@dataclass
class Position:
    step: int = 0  # the step being run (completed steps + 1)
    phase: str = "start-up"  # train step | validation | checkpoint save | signal agreement
    detail: str = ""  # micro-batch k/n, or the pipeline instruction being executed
    changes: int = 0  # bumped on every update; the watchdog's sign of progress

    def set(self, step: int | None = None, phase: str | None = None, detail: str = "") -> None:
        if step is not None:
            self.step = step
        if phase is not None:
            self.phase = phase
        self.detail = detail
        self.changes += 1

    def __str__(self) -> str:
        where = f"step {self.step}, {self.phase}"
        return f"{where}, {self.detail}" if self.detail else where


POSITION = Position()


def describe(rank: int) -> str:
    return f"rank {rank} was at {POSITION}"


def is_collective_failure(err: BaseException) -> bool:
    """A timed-out or broken collective (a peer hung or died), told by the error's type and
    where it was raised, never by the words of its message:
    - torch's distributed errors (`torch.distributed.DistError`): `DistBackendError`, which
      NCCL raises, and `DistNetworkError` / `DistStoreError` from sockets and the store;
    - gloo's timeouts and lost peers reach Python as a plain `RuntimeError` (torch 2.13; a
      test triggers one), so such an error counts when it was raised inside torch.distributed's
      own code: a blocking collective or send/recv, ours (parallel/comm.py) or DeepSpeed's.
      One surfacing from the `wait()` of an asynchronous handle, outside torch.distributed,
      is raised again as a `DistBackendError` by `comm.wait`, which every wait of ours uses.
    A `UserError` never is one, whatever its message says."""
    import torch.distributed as dist

    if isinstance(err, UserError):
        return False
    if isinstance(err, dist.DistError):
        return True
    frames = [frame for frame, _ in traceback.walk_tb(err.__traceback__)]
    return (isinstance(err, RuntimeError) and bool(frames)
            and frames[-1].f_globals.get("__name__", "").startswith("torch.distributed"))


class Watchdog:
    """Prints this rank's position once when it has not changed for `seconds`."""

    def __init__(self, rank: int, seconds: float, poll: float = 5.0):
        self.rank, self.seconds, self.poll = rank, seconds, min(poll, seconds / 20)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hang-watchdog")

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        seen, since, reported = POSITION.changes, time.monotonic(), False
        while not self._stop.wait(self.poll):
            if POSITION.changes != seen:
                seen, since, reported = POSITION.changes, time.monotonic(), False
            elif not reported and time.monotonic() - since >= self.seconds:
                print(f"[hang watchdog] {describe(self.rank)}, with no progress for "
                      f"{time.monotonic() - since:.0f} s (collectives time out soon)",
                      file=sys.stderr, flush=True)
                reported = True
