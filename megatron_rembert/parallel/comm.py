"""Every collective of the package, on tensors of the communication device.

NCCL process groups carry CUDA tensors only: a CPU scalar all-reduced on a GPU cluster raises
"No backend type associated with device type cpu" (gloo takes both). So no module calls
`torch.distributed` collectives itself (a test scans the package): they come here, where a
tensor on another device is moved to the communication device (the training device, set once by
the trainer) and back, and host numbers are reduced as one small tensor on that device.

The data-parallel gradient path's collectives (parallel/grad_buffer.py,
training/distributed_optimizer.py) come through `reduce_scatter` and `all_gather_into`, which may
run asynchronously, and every tensor collective here is counted in `TRAFFIC`: the bytes each
rank puts on the wire, per operation, in one place.

Also here: `agree_or_raise`, the one way ranks agree that a step failed on some of them (a
lock, a save, a manifest check); and the collective timeout, so that a missed collective fails
within minutes with each rank's position instead of blocking for gloo's 10 or NCCL's 30
minutes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
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


def group_size(group=None) -> int:
    """Ranks in `group` (default: every rank); 1 without a process group."""
    return dist.get_world_size(group) if is_initialized() else 1


def group_rank(group=None) -> int:
    """This rank's position in `group` (default: every rank); 0 without a process group."""
    return dist.get_rank(group) if is_initialized() else 0


# Bytes each rank sends per byte of buffer, ring algorithms (a bandwidth-only model, as
# training/communication.py's): an all-reduce is a reduce-scatter plus an all-gather.
def _wire_factor(op: str, n: int) -> float:
    return (2 if op == "all-reduce" else 1) * (n - 1) / n  # all-to-all: keeps 1/n of it


@dataclass
class Traffic:
    """What this rank's tensor collectives moved since `reset`, per operation ("all-reduce",
    "reduce-scatter", "all-gather", "all-to-all"): calls, buffer bytes (the reduced buffer,
    the whole gathered tensor, the tensor sent) and bytes on the wire (what a ring sends from
    this rank; an all-to-all sends all but its own 1/n)."""

    calls: Counter = field(default_factory=Counter)
    buffer_bytes: Counter = field(default_factory=Counter)
    wire_bytes: Counter = field(default_factory=Counter)

    def count(self, op: str, tensor: torch.Tensor, group) -> None:
        n = group_size(group)
        size = tensor.numel() * tensor.element_size()
        self.calls[op] += 1
        self.buffer_bytes[op] += size
        self.wire_bytes[op] += size * _wire_factor(op, n)

    def reset(self) -> None:
        self.calls.clear()
        self.buffer_bytes.clear()
        self.wire_bytes.clear()


TRAFFIC = Traffic()


def _on_device(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device != _DEVICE:
            raise ValueError(f"a {t.device} tensor for a collective on {_DEVICE}: buffers of "
                             "the gradient path live on the communication device")


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None,
                   async_op: bool = False):
    """Sum `input` over `group`; this rank's 1/n of the sum (its position in the group) lands
    in `output`, which may be that slice of `input` itself. Returns the work handle
    (`.wait()`) when `async_op`, else None. Both tensors on the communication device."""
    if not is_initialized():
        return _one_process(output, input, async_op)
    _on_device(output, input)
    TRAFFIC.count("reduce-scatter", input, group)
    # torch >= 2.10 names it reduce_scatter_single (reduce_scatter_tensor warns, deprecated)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group=None,
                    async_op: bool = False):
    """Every rank's `input` concatenated in group order into `output` (n x input's elements;
    `input` may be this rank's slice of `output`). Returns the work handle when `async_op`."""
    if not is_initialized():
        return _one_process(output, input, async_op)
    _on_device(output, input)
    TRAFFIC.count("all-gather", output, group)
    # torch >= 2.10 names it all_gather_single (all_gather_into_tensor warns, deprecated)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """`input` cut into n equal chunks, chunk j sent to rank j of `group`; `output` receives
    rank i's chunk as its chunk i. Returns the work handle when `async_op`."""
    if not is_initialized():
        return _one_process(output, input, async_op)
    _on_device(output, input)
    TRAFFIC.count("all-to-all", input, group)
    return dist.all_to_all_single(output, input, group=group, async_op=async_op)


class Then:
    """The handle of an asynchronous collective followed by `then()`, run once, by the first
    wait (for a result that needs local work after the data arrived). `keep`: the tensors the
    collective reads or writes, held until then."""

    def __init__(self, handle, then: Callable[[], object], keep: tuple = ()):
        self.handle, self.then, self.keep = handle, then, keep

    def wait(self) -> bool:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
            self.then()
            self.keep = ()
        return True


def wait(handle) -> None:
    """Wait for an asynchronous collective (the handle `reduce_scatter` or `all_gather_into`
    gave). gloo reports a lost or hung peer from `wait()` as a plain RuntimeError, raised
    outside torch.distributed's code; it is raised again as torch's DistBackendError, which
    NCCL raises and training/hang.py recognises as a collective failure."""
    try:
        handle.wait()
    except dist.DistError:
        raise
    except RuntimeError as err:
        raise dist.DistBackendError(str(err)) from err


def _one_process(output: torch.Tensor, input: torch.Tensor, async_op: bool):
    """A reduce-scatter or all-gather over one rank: `input` is the result."""
    if output.data_ptr() != input.data_ptr():
        output.copy_(input)
    return _Done() if async_op else None


class _Done:
    """The handle of a collective that had nothing to do (one process)."""

    def wait(self) -> bool:
        return True


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
               group=None) -> torch.Tensor:
    """All-reduce `tensor` in place over `group` (default: every rank) and return it.

    A tensor that is not on the communication device is reduced in a copy there and copied
    back, so callers never hand NCCL a CPU tensor.
    """
    if not is_initialized():
        return tensor
    work = tensor if tensor.device == _DEVICE else tensor.to(_DEVICE)
    TRAFFIC.count("all-reduce", work, group)
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


def new_host_group():
    """A gloo group of every rank for host-side agreement off the training thread (the
    background checkpoint writer): its collectives never interleave with those the training
    issues on the default group. Every rank must call this, in the same order."""
    return dist.new_group(backend="gloo") if is_initialized() else None


def host_all_reduce(value: float, host_group, op: dist.ReduceOp = dist.ReduceOp.SUM) -> float:
    """One host number reduced on CPU over a group from `new_host_group` (off the training
    thread: never on the communication device)."""
    work = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(work, op=op, group=host_group)
    return float(work[0])


@contextmanager
def agree_or_raise(catch: type[BaseException] | tuple[type[BaseException], ...],
                   failure: Callable[[BaseException | None, int], BaseException],
                   host_group=None) -> Iterator[None]:
    """Run the block on every rank, then agree in one collective (also a barrier) whether it
    failed on any: an error of type `catch` is held until then, so no rank is left waiting in
    a collective that a failed rank never reaches. When n ranks failed, every rank raises
    `failure(its own error or None, n)` (`failure` may return the error itself).
    `host_group` (from `new_host_group`): agree on CPU over that group instead."""
    error = None
    try:
        yield
    except catch as err:
        error = err
    flag = 0.0 if error is None else 1.0
    (failed,) = ([host_all_reduce(flag, host_group)] if host_group is not None
                 else all_reduce_values([flag]))
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
