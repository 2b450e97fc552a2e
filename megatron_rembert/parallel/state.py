"""Process groups for a parallel layout (parallel/layout.py), tensor-parallel ranks adjacent.

The groups follow the layout's rank order, that of DeepSpeed's `PipeModelDataParallelTopology`,
so our groups, the pipeline engine and ZeRO agree on who is who. Tensor-parallel peers are
adjacent ranks, i.e. on one node when tp <= GPUs per node.

The state is a module-level singleton, as in Megatron-LM: layers ask for the TP group when they
run. Without `initialize_model_parallel` everything is a single process (tp = pp = dp = 1) and
every collective is the identity.

The package's process-wide state, all of it (a process is one rank): these groups, the
communication device (`comm.set_device`) and the TP dropout stream (`random`); in the data
loader's worker processes also their batch maker. `parallel.reset.reset_process_state()`
returns the first three to a fresh process's. Nothing else is global: an fp8 layer's weight
cache is its own (parallel/fp8.py); tests/parallel/test_process_state.py keeps this list true.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

from megatron_rembert.parallel.layout import Layout, layout_rank


@dataclass
class ParallelState:
    """The process groups of this rank; its sizes and ranks are its layout's (read through,
    never copied)."""

    layout: Layout = field(default_factory=Layout)
    tp_group: object = None
    pp_group: object = None
    dp_group: object = None
    # Ranks of the whole model replica (tp x pp) this rank belongs to.
    model_group: object = None

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank

    @property
    def pp_rank(self) -> int:
        return self.layout.pp_rank

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank


_STATE = ParallelState()


def initialize_model_parallel(layout: Layout) -> ParallelState:
    """Build the TP, PP, DP and model groups of `layout` over the default process group;
    every rank calls it."""
    global _STATE
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if (layout.world_size, layout.rank) != (world, rank):
        raise ValueError(f"layout of {layout.world_size} processes for rank {layout.rank}, but "
                         f"this is rank {rank} of {world}")
    if not dist.is_initialized():
        _STATE = ParallelState()
        return _STATE
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    state = ParallelState(layout)
    # new_group is collective: every rank creates every group, in the same order.
    for p in range(pp):
        for d in range(dp):
            ranks = [layout_rank(p, d, t, dp, tp) for t in range(tp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                state.tp_group = group
    for p in range(pp):
        for t in range(tp):
            ranks = [layout_rank(p, d, t, dp, tp) for d in range(dp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                state.dp_group = group
    for d in range(dp):
        for t in range(tp):
            ranks = [layout_rank(p, d, t, dp, tp) for p in range(pp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                state.pp_group = group
    for d in range(dp):
        ranks = [layout_rank(p, d, t, dp, tp) for p in range(pp) for t in range(tp)]
        group = dist.new_group(ranks)
        if rank in ranks:
            state.model_group = group
    _STATE = state
    return state


def destroy_model_parallel() -> None:
    global _STATE
    _STATE = ParallelState()


def get_state() -> ParallelState:
    return _STATE


@contextmanager
def offline(tp: int, tp_rank: int = 0) -> Iterator[ParallelState]:
    """Act as TP rank `tp_rank` of `tp` in this process, without process groups: for building
    a model's shapes offline (checkpoint conversion). Restores the previous state on exit."""
    global _STATE
    old, _STATE = _STATE, ParallelState(Layout(tp=tp, rank=tp_rank))
    try:
        yield _STATE
    finally:
        _STATE = old


def tp_size() -> int:
    return _STATE.tp


def tp_rank() -> int:
    return _STATE.tp_rank


def tp_group():
    return _STATE.tp_group


class DeepSpeedMPU:
    """The `mpu` object DeepSpeed asks for: TP is its "model parallel" axis.

    DeepSpeed uses it for gradient-norm reduction across TP (counting TP-replicated
    parameters once) and for naming checkpoint files by TP rank.
    """

    def get_model_parallel_rank(self) -> int:
        return _STATE.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return _STATE.tp

    def get_model_parallel_group(self):
        return _STATE.tp_group

    def get_data_parallel_rank(self) -> int:
        return _STATE.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return _STATE.dp

    def get_data_parallel_group(self):
        return _STATE.dp_group

    def get_pipe_parallel_rank(self) -> int:
        return _STATE.pp_rank

    def get_pipe_parallel_world_size(self) -> int:
        return _STATE.pp

    def get_pipe_parallel_group(self):
        return _STATE.pp_group

    # DeepSpeed's names for the same things in some code paths.
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group
