"""Autograd-aware collectives at the edges of tensor-parallel regions (Megatron's f and g).

- `copy_to_tp`: identity forward, all-reduce of the gradient backward. Placed where a
  replicated activation enters a region whose ranks each use it with their own weight shard.
- `reduce_from_tp`: all-reduce forward, identity backward. Placed where each rank holds a
  partial sum (row-parallel linear, vocab-parallel embedding).

Every all-reduce goes through `all_reduce_` (and from there through `parallel.comm`), which
counts calls in `ALL_REDUCE_COUNTS` and buffer bytes in `ALL_REDUCE_BYTES`, by tag, so tests
can check the communication plan (exactly one forward all-reduce per attention and FFN block;
the bytes `--dry-run` counts from model/cost.py's `tp_all_reduces`). The sum over the TP group
(every all-reduce of a Transformer layer) is the custom operator
`megatron_rembert::tp_all_reduce_`: torch.compile keeps it as one opaque call inside the layer's
graph (dynamo refuses the counter's update inside an autograd Function, and an opaque call needs
nothing traceable from the backend, gloo included), so a compiled layer stays one graph under
tensor parallelism.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from megatron_rembert.parallel import comm, state

ALL_REDUCE_COUNTS: Counter = Counter()
ALL_REDUCE_BYTES: Counter = Counter()


def _count(tensor: torch.Tensor, tag: str) -> None:
    ALL_REDUCE_COUNTS[tag] += 1
    ALL_REDUCE_BYTES[tag] += tensor.numel() * tensor.element_size()


@torch.library.custom_op("megatron_rembert::tp_all_reduce_", mutates_args=("tensor",))
def _tp_all_reduce_(tensor: torch.Tensor, tag: str) -> None:
    """In-place sum over the TP group."""
    _count(tensor, tag)
    comm.all_reduce(tensor, group=state.tp_group())


def all_reduce_(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, tag: str = "") -> None:
    """In-place all-reduce over `group` (default: the TP group); a no-op for tp = 1."""
    if group is None:
        if state.tp_size() == 1:
            return
        if op == dist.ReduceOp.SUM:
            _tp_all_reduce_(tensor, tag)
            return
        group = state.tp_group()
    _count(tensor, tag)
    comm.all_reduce(tensor, op=op, group=group)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        all_reduce_(grad, tag="backward")
        return grad


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        if x.is_contiguous():
            ctx.mark_dirty(x)  # reduced in place, as Megatron does: no extra activation copy
        else:
            x = x.contiguous()
        all_reduce_(x, tag="forward")
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def copy_to_tp(x: torch.Tensor) -> torch.Tensor:
    if state.tp_size() == 1:
        return x
    return _CopyToTP.apply(x)


def reduce_from_tp(x: torch.Tensor) -> torch.Tensor:
    if state.tp_size() == 1:
        return x
    return _ReduceFromTP.apply(x)
