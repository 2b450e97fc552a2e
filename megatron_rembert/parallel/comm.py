"""Every collective of the package, on tensors of the communication device.

NCCL process groups carry CUDA tensors only: a CPU scalar all-reduced on a GPU cluster raises
"No backend type associated with device type cpu" (gloo takes both). So no module calls
`torch.distributed` collectives itself (a test scans the package): they come here, where a
tensor on another device is moved to the communication device (the training device, set once by
the trainer) and back, and host numbers are reduced as one small tensor on that device.

Also here: `agree_or_raise`, the one way ranks agree that a step failed on some of them (a
lock, a save, a manifest check); and the collective timeout, so that a missed collective fails
within minutes with each rank's position instead of blocking for gloo's 10 or NCCL's 30
minutes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

_DEVICE = torch.device("cpu")


def set_device(device: torch.device | str) -> None:
    """The device collectives run on: the training device (CUDA under NCCL)."""
    global _DEVICE
    _DEVICE = torch.device(device)


def device() -> torch.device:
    return _DEVICE


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
               group=None) -> torch.Tensor:
    """All-reduce `tensor` in place over `group` (default: every rank) and return it.

    A tensor that is not on the communication device is reduced in a copy there and copied
    back, so callers never hand NCCL a CPU tensor.
    """
    if not is_initialized():
        return tensor
    work = tensor if tensor.device == _DEVICE else tensor.to(_DEVICE)
    dist.all_reduce(work, op=op, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_reduce_values(values: Sequence[float], op: dist.ReduceOp = dist.ReduceOp.SUM,
                      group=None) -> list[float]:
    """Host numbers reduced over `group`: one float64 tensor on the communication device, one
    collective, one read-back."""
    if not is_initialized():
        return [float(v) for v in values]
    reduced = all_reduce(torch.tensor(values, dtype=torch.float64, device=_DEVICE), op, group)
    return to_host(reduced)


def to_host(tensor: torch.Tensor) -> list[float]:
    """The one place reduced values come back to the host (a test patches it)."""
    return tensor.tolist()


@contextmanager
def agree_or_raise(catch: type[BaseException] | tuple[type[BaseException], ...],
                   failure: Callable[[BaseException | None, int], BaseException]
                   ) -> Iterator[None]:
    """Run the block on every rank, then agree in one collective (also a barrier) whether it
    failed on any: an error of type `catch` is held until then, so no rank is left waiting in
    a collective that a failed rank never reaches. When n ranks failed, every rank raises
    `failure(its own error or None, n)` (`failure` may return the error itself)."""
    error = None
    try:
        yield
    except catch as err:
        error = err
    (failed,) = all_reduce_values([0.0 if error is None else 1.0])
    if error is None and not failed:
        return
    raised = failure(error, int(failed))
    if raised is error:
        raise error
    raise raised from error


def barrier(group=None) -> None:
    """Every rank of `group` has reached this point; an all-reduce on the communication device,
    which every backend supports (NCCL's own barrier must guess the rank's GPU)."""
    if is_initialized():
        all_reduce(torch.zeros(1, device=_DEVICE), group=group)


def set_default_timeout(minutes: float) -> timedelta:
    """The timeout of every process group created from now on, by us or by DeepSpeed.

    torch gives a group created without an explicit timeout the module default of its backend
    (10 minutes for gloo, 10 or 30 for NCCL), and DeepSpeed's pipeline grid creates its groups
    without one; setting that default is the only way to reach them all.
    """
    from torch.distributed import distributed_c10d

    timeout = timedelta(minutes=minutes)
    distributed_c10d.default_pg_timeout = timeout
    if isinstance(getattr(distributed_c10d, "default_pg_nccl_timeout", None), timedelta):
        distributed_c10d.default_pg_nccl_timeout = timeout
    return timeout
