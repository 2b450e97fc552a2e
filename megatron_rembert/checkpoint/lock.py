"""One run per save folder: `save_dir/.lock` holds the owner's host and pid.

A second run on the same folder refuses to start. A lock is stale, and taken over, when its pid
is dead on this host (the run was killed -9) or when it was taken by an earlier incarnation of
this SLURM job (a requeue runs only after that one ended, maybe on another node). Any other
lock from another host cannot be checked from here: the message says which host to look at.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from megatron_rembert.checkpoint import CheckpointError

LOCK = ".lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


class SaveDirLock:
    """`with SaveDirLock(save_dir, flag="train.save_dir"):` — also proves the folder writable."""

    def __init__(self, save_dir: str | Path, flag: str = "train.save_dir"):
        self.path = Path(save_dir) / LOCK
        self.flag = flag
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
                with os.fdopen(fd, "w") as f:
                    json.dump({"host": socket.gethostname(), "pid": os.getpid(),
                               "slurm_job": os.environ.get("SLURM_JOB_ID"),
                               "since": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
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
        except (OSError, ValueError, KeyError, TypeError):
            holder, host, pid = {}, "?", -1
        job = os.environ.get("SLURM_JOB_ID")
        dead = host == socket.gethostname() and pid > 0 and not _alive(pid)
        if dead or (job and holder.get("slurm_job") == job):
            self.path.unlink(missing_ok=True)  # stale: its owner died without cleaning up
            return
        raise CheckpointError(
            f"{self.flag}={self.path.parent} is in use by pid {pid} on host {host} (since "
            f"{holder.get('since', '?')}, lock file {self.path}); stop that run first, or "
            "delete the lock file if it is gone")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> SaveDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
