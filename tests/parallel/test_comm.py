"""Collectives only on the communication device, and only through parallel/comm.py.

NCCL carries CUDA tensors only; no GPU here, so the communication device is patched to
"meta" (a device that is not the CPU) and the collective is mocked to record what it is given.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import megatron_rembert
from megatron_rembert.parallel import comm
from megatron_rembert.training import checkpoint as ckpt
from megatron_rembert.training.signals import StopFlag

PACKAGE = Path(megatron_rembert.__file__).parent
# Every collective and point-to-point call of torch.distributed (and deepspeed.comm).
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_object", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "batch_isend_irecv", "broadcast", "broadcast_object_list", "gather", "gather_object",
    "irecv", "isend", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "scatter", "scatter_object_list", "send",
}
DIST_MODULES = {"torch.distributed", "deepspeed.comm"}


def _direct_collectives(source: str) -> list[str]:
    """Calls of a collective on torch.distributed / deepspeed.comm, however imported."""
    tree = ast.parse(source)
    aliases, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in DIST_MODULES:
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if f"{node.module}.{a.name}" in DIST_MODULES:
                    aliases.add(a.asname or a.name)
                elif node.module in DIST_MODULES and a.name in COLLECTIVES:
                    names.add(a.asname or a.name)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in names:
            found.append(f"line {node.lineno}: {func.id}")
        elif isinstance(func, ast.Attribute) and func.attr in COLLECTIVES \
                and ast.unparse(func.value) in aliases | DIST_MODULES:
            found.append(f"line {node.lineno}: {ast.unparse(func)}")
    return found


def test_scanner_finds_every_spelling():
    source = ("import torch.distributed as dist\nimport torch\n"
              "from torch.distributed import all_reduce as ar\nfrom torch import distributed\n"
              "dist.all_reduce(t)\ntorch.distributed.barrier()\nar(t)\ndistributed.send(t, 1)\n"
              "dist.get_rank()\n")
    assert len(_direct_collectives(source)) == 4


def test_no_collective_outside_the_comm_helper():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "parallel" / "comm.py":
            continue
        found = _direct_collectives(path.read_text())
        if found:
            offenders[str(path.relative_to(PACKAGE))] = found
    assert not offenders, f"call parallel.comm instead: {offenders}"


@pytest.fixture
def meta_comm(monkeypatch):
    """A process group of 2 whose collectives record the device of what they are given."""
    seen = []
    monkeypatch.setattr(comm, "_DEVICE", torch.device("meta"))
    monkeypatch.setattr(comm, "is_initialized", lambda: True)
    monkeypatch.setattr(comm, "rank", lambda: 0)
    monkeypatch.setattr(comm, "group_size", lambda group=None: 2)
    monkeypatch.setattr(comm.dist, "all_reduce",
                        lambda t, op=None, group=None: seen.append(t.device))
    monkeypatch.setattr(comm, "to_host", lambda t: [0.0] * t.numel())
    return seen


def test_host_numbers_go_to_the_communication_device(meta_comm):
    assert comm.all_reduce_values([1.0, 2.0]) == [0.0, 0.0]
    comm.barrier()
    assert meta_comm == [torch.device("meta")] * 2


def test_stop_flag_agrees_on_the_communication_device(meta_comm):
    assert StopFlag().agreed() is False
    assert meta_comm == [torch.device("meta")]


class _Optimizer:
    """Stands for the distributed optimizer in a save: no loss scaler, nothing in flight."""

    loss_scaler = None

    def wait_for_weights(self) -> None:
        pass


class _Engine:
    module = torch.nn.Linear(2, 2)  # checked finite before the save
    optimizer = _Optimizer()
    lr_scheduler = None


def test_checkpoint_save_agrees_on_the_communication_device(meta_comm, tmp_path, monkeypatch):
    from megatron_rembert.checkpoint import optimizer_shards

    monkeypatch.setattr(optimizer_shards, "collect", lambda *args, **kwargs: optimizer_shards
                        .Collected(optimizer_shards.shard_file(0, 0, 0), [], {"format": "x"}))
    monkeypatch.setattr(ckpt, "_specs", lambda engine, meta: {})
    ckpt.save_checkpoint(_Engine(), tmp_path, 3, 24, {}, keep_last=1)
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"
    assert meta_comm and set(meta_comm) == {torch.device("meta")}


class _Refused(Exception):
    pass


def _agree_worker(rank, world_size, failing: list[int]) -> tuple[str, str]:
    """Ranks in `failing` fail inside the block; every rank reports what it raised: its own
    error, or the one `failure` made (with how many ranks failed)."""
    def failure(error, ranks):
        return error or _Refused(f"{ranks} other rank(s) failed")

    try:
        with comm.agree_or_raise(ValueError, failure):
            if rank in failing:
                raise ValueError(f"rank {rank} failed")
    except (ValueError, _Refused) as err:
        return type(err).__name__, str(err)
    return "none", ""


@pytest.mark.multiprocess
def test_agree_or_raise_tells_every_rank():
    """One rank fails: it raises its own error, the others learn it failed (no rank left
    waiting in a collective); none fails: nobody raises."""
    from tests.distributed import run_distributed

    assert run_distributed(_agree_worker, 3, [1]) == [
        ("_Refused", "1 other rank(s) failed"), ("ValueError", "rank 1 failed"),
        ("_Refused", "1 other rank(s) failed")]
    assert run_distributed(_agree_worker, 2, []) == [("none", "")] * 2


def test_agree_or_raise_on_the_communication_device(meta_comm):
    """One collective on the communication device; this rank's error is raised whatever the
    others report (here: nothing), a failure made anew names its cause, an error of another
    type is not held."""
    with comm.agree_or_raise(ValueError, lambda error, ranks: error):
        pass
    assert meta_comm == [torch.device("meta")]
    made = RuntimeError("saving failed")
    with pytest.raises(RuntimeError, match="saving failed") as raised:
        with comm.agree_or_raise(OSError, lambda error, ranks: made):
            raise OSError(28, "No space left on device")
    assert isinstance(raised.value.__cause__, OSError)
    with pytest.raises(KeyError):
        with comm.agree_or_raise(OSError, lambda error, ranks: made):
            raise KeyError("not an OSError")
    assert len(meta_comm) == 2  # the KeyError left before the agreement
