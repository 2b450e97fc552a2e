"""Record, per process group, the order in which a rank issues and waits for collectives, and
its host reads; and the rule NCCL imposes on that order.

NCCL runs the operations of one communicator in the order they were issued. A blocking
collective issued on a group while an asynchronous collective on the same group is still
unwaited therefore waits for it: the asynchronous one is no longer overlapped with anything,
whatever the code meant. gloo does not serialise this way, so a CPU run only shows the
problem if the order itself is recorded and checked. A host read (`.item()`, `.tolist()`,
`float(t)`, ...) in the same window makes the host wait for the device, which on a GPU is what
the asynchronous collective was meant to hide behind.

`record()` wraps torch.distributed's functions (before DeepSpeed binds them:
`deepspeed.init_distributed` looks them up at call time, and the pipeline engine calls them
directly) and torch.Tensor's host-read methods, in the process it runs in (a test worker).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

# torch.distributed function -> the operation it performs
OPS = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather",
       "all_gather_single": "all-gather", "reduce_scatter_single": "reduce-scatter",
       "reduce_scatter_tensor": "reduce-scatter", "all_gather": "all-gather",
       "broadcast": "broadcast", "all_to_all_single": "all-to-all", "barrier": "barrier",
       "send": "send", "recv": "recv", "isend": "send", "irecv": "recv"}
# where the group argument sits when it is passed by position
GROUP_POSITION = {"all_reduce": 2, "broadcast": 2, "all_gather": 2, "all_gather_into_tensor": 2,
                  "all_gather_single": 2, "reduce_scatter_tensor": 3,
                  "reduce_scatter_single": 3, "all_to_all_single": 4, "barrier": 0}
POINT_TO_POINT = {"send", "recv", "isend", "irecv"}
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "numpy")


@dataclass(frozen=True)
class Event:
    kind: str  # "issue" (asynchronous), "blocking", "wait" (of an issue), "read" (host)
    op: str  # the operation, or the host-read method
    group: str  # the group's name (`Recorder.name`, else its ranks and identity); "peer N"
    # for point-to-point; "" for a read
    call: int  # the number (its wait carries the same)


class _Handle:
    """An asynchronous collective's work handle that records its first wait."""

    def __init__(self, work, on_wait):
        self._work, self._on_wait = work, on_wait

    def wait(self, *args, **kwargs):
        if self._on_wait is not None:
            self._on_wait()
            self._on_wait = None
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class Recorder:
    def __init__(self):
        self.events: list[Event] = []
        self.on = True  # recording (off: calls still run, nothing is kept)
        self._calls = 0
        self._names: dict[int, str] = {}
        self._thread = threading.get_ident()

    def name(self, group, label: str) -> None:
        """How events on `group` (a process group) are named."""
        self._names[id(group)] = label

    def clear(self) -> None:
        del self.events[:]

    def _add(self, event: Event) -> None:
        """Events of the thread that made the recorder only (the training thread: a
        background checkpoint writer's collectives run on a group of their own, and its host
        reads make no device wait)."""
        if self.on and threading.get_ident() == self._thread:
            self.events.append(event)

    def _group(self, name: str, args: tuple, kwargs: dict) -> str:
        """The group a call runs on: by identity, not by ranks (two groups of the same ranks
        are two communicators)."""
        import torch.distributed as dist

        if name in POINT_TO_POINT:
            peer = kwargs.get("dst", kwargs.get("src"))
            return f"peer {args[1] if peer is None else peer}"
        group = kwargs.get("group")
        if group is None and len(args) > GROUP_POSITION[name]:
            group = args[GROUP_POSITION[name]]
        group = group or dist.group.WORLD
        if id(group) not in self._names:
            ranks = tuple(dist.get_process_group_ranks(group))
            self._names[id(group)] = f"group {ranks} #{len(self._names)}"
        return self._names[id(group)]

    def wrap_collective(self, name: str, fn):
        def recorded(*args, **kwargs):
            group = self._group(name, args, kwargs)
            asynchronous = kwargs.get("async_op", False) or name in ("isend", "irecv")
            self._calls += 1
            call = self._calls
            self._add(Event("issue" if asynchronous else "blocking", OPS[name], group, call))
            work = fn(*args, **kwargs)
            if asynchronous and work is not None:
                return _Handle(work, lambda: self._add(Event("wait", OPS[name], group, call)))
            return work
        return recorded

    def wrap_read(self, name: str, fn):
        def recorded(tensor, *args, **kwargs):
            self._add(Event("read", name, "", 0))
            return fn(tensor, *args, **kwargs)
        return recorded


def record() -> Recorder:
    """Wrap torch.distributed's collectives and torch.Tensor's host reads in this process;
    returns the recorder their calls go to."""
    import torch
    import torch.distributed as dist

    recorder = Recorder()
    for name in OPS:
        if hasattr(dist, name):
            setattr(dist, name, recorder.wrap_collective(name, getattr(dist, name)))
    for name in HOST_READS:
        setattr(torch.Tensor, name, recorder.wrap_read(name, getattr(torch.Tensor, name)))
    return recorder


def violations(events: list[Event]) -> list[str]:
    """Where the order breaks NCCL's rule: a blocking collective on a group while an
    asynchronous collective issued on that group is unwaited, or a host read while an
    all-gather or reduce-scatter is unwaited. Point-to-point sends and receives are not
    checked (DeepSpeed's pipeline engine waits for them at once)."""
    in_flight: dict[int, tuple[int, Event]] = {}
    found = []
    for i, e in enumerate(events):
        if e.kind == "issue" and e.op not in ("send", "recv"):
            in_flight[e.call] = (i, e)
        elif e.kind == "wait":
            in_flight.pop(e.call, None)
        elif e.kind == "blocking":
            found += [f"event {i}: blocking {e.op} on group {e.group} while the {a.op} issued "
                      f"at event {j} on it is unwaited" for j, a in in_flight.values()
                      if a.group == e.group]
        elif e.kind == "read":
            found += [f"event {i}: host read ({e.op}) while the {a.op} issued at event {j} on "
                      f"group {a.group} is unwaited" for j, a in in_flight.values()]
    return found


def sequence(events: list[Event], group: str) -> list[tuple[str, str]]:
    """The (kind, op) of the events on `group`, in order."""
    return [(e.kind, e.op) for e in events if e.group == group]
