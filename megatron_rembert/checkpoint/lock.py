"""One run per save folder: `save_dir/.lock` holds the owner's host and pid.

A second run on the same folder refuses to start. A lock is stale, and taken over, when its pid
is dead on this host (the run was killed -9) or when it was taken by an earlier incarnation of
this SLURM job (a requeue runs only after that one ended, maybe on another node), and when it
is empty or unreadable and older than `UNWRITTEN_SECONDS` (its owner was killed between
creating it and writing its record, microseconds apart: no live run leaves one like that).
Any other lock from another host cannot be checked from here: the message says which host to
look at.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from megatron_rembert.checkpoint import CheckpointError

LOCK = ".lock"
# A lock without a record this old is stale: a run writes its record right after creating it.
UNWRITTEN_SECONDS = 10.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


class SaveDirLock:
    """`with SaveDirLock(save_dir, flag="train.save_dir"):` — also proves the folder writable.
    `job`: this run's SLURM job id (launch_env.LaunchEnv.slurm_job_id), None outside SLURM."""

    def __init__(self, save_dir: str | Path, flag: str = "train.save_dir",
                 job: str | None = None):
        self.path = Path(save_dir) / LOCK
        self.flag = flag
        self.job = job
        self.held = False

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(2):  # a second try after removing a stale lock
                try:
                    fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    self._check_holder()
                    continue
                try:
                    with os.fdopen(fd, "w") as f:
                        json.dump({"host": socket.gethostname(), "pid": os.getpid(),
                                   "slurm_job": self.job,
                                   "since": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
                except OSError:  # a full disk: no empty lock left behind
                    self.path.unlink(missing_ok=True)
                    raise
                self.held = True
                return
        except OSError as err:
            raise CheckpointError(f"{self.flag}={self.path.parent}: not writable "
                                  f"({err.strerror or err}); fix the permissions or choose "
                                  "another folder") from err
        raise CheckpointError(f"{self.path}: could not take the lock")

    def _check_holder(self) -> None:
        try:
            holder = json.loads(self.path.read_text())
            host, pid = holder["host"], int(holder["pid"])
        except FileNotFoundError:
            return  # released meanwhile: try again
        except (OSError, ValueError, KeyError, TypeError):
            self._check_unwritten()
            return
        dead = host == socket.gethostname() and pid > 0 and not _alive(pid)
        if dead or (self.job and holder.get("slurm_job") == self.job):
            self.path.unlink(missing_ok=True)  # stale: its owner died without cleaning up
            return
        raise CheckpointError(
            f"{self.flag}={self.path.parent} is in use by pid {pid} on host {host} (since "
            f"{holder.get('since', '?')}, lock file {self.path}); stop that run first, or "
            "delete the lock file if it is gone")

    def _check_unwritten(self) -> None:
        """A lock without a readable record: stale once it is old enough (see the module)."""
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return
        if age >= UNWRITTEN_SECONDS:
            self.path.unlink(missing_ok=True)
            return
        raise CheckpointError(
            f"{self.flag}={self.path.parent}: its lock file {self.path} has no owner record "
            f"yet (created {age:.0f} s ago): another run may be taking it right now; retry in "
            f"{UNWRITTEN_SECONDS:.0f} s, when an unwritten lock counts as stale")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> SaveDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
