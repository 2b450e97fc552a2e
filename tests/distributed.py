"""Run a function on N gloo ranks on localhost and collect what each rank returns.

Used by every distributed test: the result of a multi-process run is compared against a
single-process run of the same thing. A hang (a missed collective) fails the test after
`timeout` seconds instead of blocking CI.
"""

from __future__ import annotations

import io
import os
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks are forked from a server process that has imported torch and DeepSpeed already (a
# spawned rank imported them itself: about 2 s of CPU per rank, most of the start-up cost of
# the suite's distributed tests). Only third-party modules: ours keep import-time state (the
# process's start time, which the time limit and the start-up lines count from). What a
# spawned rank would get from the parent at the call, a forked one is handed: the
# environment, and the parent's stdout and stderr as they are now (a test captures them).
PRELOAD = ["torch", "deepspeed"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class _InheritedFd:
    """One of the parent's file descriptors, sent to the forked rank with the process."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _InheritedFd._received, (reduction.DupFd(self.fd),)

    @staticmethod
    def _received(dup) -> int:
        return dup.detach()


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue,
            init: bool, environ: dict[str, str], stdio: tuple[int, int]) -> None:
    os.environ.clear()
    os.environ.update(environ)
    for target, fd in zip((1, 2), stdio, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Serialised to bytes: tensors sent as-is travel as shared-memory handles, which die
        # with this process before the parent reads them.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180,
                    init_process_group: bool = True) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return results by rank.

    `fn` must be importable (a module-level function) and its result picklable. With
    `init_process_group=False` only torchrun's environment is set, and `fn` initialises the
    process group itself, as train.py does.
    """
    ctx = _context()
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, init_process_group,
                          dict(os.environ), (_InheritedFd(1), _InheritedFd(2))),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        if time.monotonic() > deadline:
            break
        if queue.empty():
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.05)
            continue
        rank, status, payload = queue.get()
        if status == "ok":
            # Our own child's output, written just above: full unpickling is safe here.
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{payload}")
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("distributed run failed\n" + "\n".join(errors))
    if len(results) != world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise AssertionError(f"ranks {missing} hung or died (timeout {timeout}s)")
    return [results[r] for r in range(world_size)]
