"""What one optimizer step communicates per rank, and the time it adds at a stated link
bandwidth: the collectives of the tensor-parallel (TP), pipeline (PP) and data-parallel (DP)
groups as the code issues them, allocating nothing. `--dry-run` prints them
(training/dry_run.py); tests/training/test_communication_counted.py counts the real calls of a
training step against them.

Bytes on the wire per rank (a bandwidth-only model: no latency term):
    ring all-reduce of a B-byte buffer over n ranks     2(n-1)/n x B sent (and as many received)
    all-gather into / reduce-scatter of a B-byte buffer  (n-1)/n x B
    all-to-all of a B-byte buffer                        (n-1)/n x B (1/n stays on the rank)
    send or receive of a B-byte message                  B
A group whose ranks are not all on one node runs at the inter-node bandwidth; ranks fill nodes
in order (rank // gpus_per_node is the node), as torchrun and SLURM place them.

What overlaps compute (the rest is exposed: bytes / bandwidth adds to the step):
- TP: every all-reduce sits between two matmuls that need its result, and the pipeline's
  all-gather of the hidden states comes before the stage's compute: exposed.
- PP: DeepSpeed's pipeline engine sends and receives with blocking calls between its 1F1B
  compute instructions: exposed, both directions.
- DP (training/data_parallel.py): the fp32 gradients reduce-scattered bucket by bucket
  (parallel/grad_buffer.py's layout, one call per bucket; with parallel.grad_reduce_dtype=bf16
  an all-to-all of each bucket's bf16 copy instead) during the last micro-batch's backward on
  this rank (at pp > 1 the stage's last backward of the schedule); the weights' all-gather,
  bucket by bucket, with parallel.overlap_weight_gather (the default) in flight while the next
  step's first forward runs, each layer waiting for its own bucket; without it, inside the
  step. What of them is exposed comes from the order the step issues and waits for them,
  NCCL's queue per group included (training/step_order.py: `simulate` on `dp_order`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_rembert.data import batch
from megatron_rembert.model.cost import tp_all_reduces
from megatron_rembert.model.pipeline import PIPE_ACTIVATIONS
from megatron_rembert.parallel.layout import Layout, layout_rank
from megatron_rembert.run_config.schema import Config
from megatron_rembert.training.links import LinkAssumptions
from megatron_rembert.training.plan import RunPlan
from megatron_rembert.training.step_order import dp_order, simulate, stage_buckets

# How the DP gradients are reduced (one path, every run: training/data_parallel.py).
DP_PATH = ("our buckets, reduced over DP during the last backward (fp32 reduce-scatter, or "
           "parallel.grad_reduce_dtype=bf16's all-to-all), then the weights' all-gather (during "
           "the next forward)")
META_ELEMENTS_BASE = 7  # DeepSpeed's PartitionedTensor meta: [3, B, S, H, tp, rank, tp+1 bounds]


def activation_bytes(config: Config) -> int:
    """Bytes of one activation element: the training precision's."""
    return 2 if config.train.precision in ("bf16", "fp16") else 4


@dataclass(frozen=True)
class Collective:
    """Calls of one kind a rank makes per optimizer step."""

    group: str  # "TP", "PP" or "DP"
    op: str  # "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "send", "recv"
    what: str
    buffer_bytes: int  # summed over the calls: the buffer reduced, the whole gathered tensor,
    # or the message sent or received
    calls: int
    ranks: tuple[int, ...]  # the group's ranks; for send and recv (this rank, its peer)
    overlap: str = "none"  # "none", "backward": hidden behind the last backward, or
    # "forward": behind the next step's first forward

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends (ring collectives send as many as they receive)."""
        return self.buffer_bytes * wire_factor(self.op, self.size)


def wire_factor(op: str, n: int) -> float:
    """Bytes on the wire per rank per byte of buffer (see the module docstring)."""
    if op == "all-reduce":
        return 2 * (n - 1) / n
    if op in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n
    if op in ("send", "recv"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def stage_rank(layout: Layout, stage: int) -> int:
    """The rank whose step is counted for pipeline stage `stage` (DP and TP rank 0; every rank
    of a stage makes the same calls)."""
    return layout_rank(stage, 0, 0, layout.dp, layout.tp)


def group_ranks(layout: Layout, rank: int, group: str) -> tuple[int, ...]:
    """The ranks of `rank`'s TP, DP or PP group."""
    pp, dp, tp = (rank // (layout.dp * layout.tp), (rank // layout.tp) % layout.dp,
                  rank % layout.tp)
    if group == "TP":
        return tuple(layout_rank(pp, dp, t, layout.dp, layout.tp) for t in range(layout.tp))
    if group == "DP":
        return tuple(layout_rank(pp, d, tp, layout.dp, layout.tp) for d in range(layout.dp))
    return tuple(layout_rank(p, dp, tp, layout.dp, layout.tp) for p in range(layout.pp))


def _tp(config: Config, plan: RunPlan, layers: range, rank: int) -> list[Collective]:
    layout = plan.layout
    if layout.tp == 1:
        return []
    per_layer = tp_all_reduces(config.model, config.data.seq_length, plan.data.max_predictions,
                               layout.micro_batch_size, config.parallel.activation_checkpointing,
                               activation_bytes(config))
    merged: dict[tuple[str, str], list[int]] = {}
    for k in layers:
        for r in per_layer[k]:
            total = merged.setdefault((r.tag, r.what), [0, 0])
            total[0] += r.buffer_bytes * r.calls * layout.gas
            total[1] += r.calls * layout.gas
    ranks = group_ranks(layout, rank, "TP")
    return [Collective("TP", "all-reduce", f"{what} ({tag})", size, calls, ranks)
            for (tag, what), (size, calls) in merged.items()]


def _pp(config: Config, plan: RunPlan, stage: int, rank: int) -> list[Collective]:
    """DeepSpeed's pipeline engine, per micro-batch: the hidden states forward and their
    gradient back; the masks, positions, labels and weights forward only (integers get no
    gradient). At tp > 1 it sends each TP rank's 1/tp part of the hidden states with a small
    int64 meta tensor, and the receiving stage all-gathers them over TP (the sending stage too,
    to rebuild its output before backward, and the gradient it receives)."""
    layout = plan.layout
    if layout.pp == 1:
        return []
    tp, gas, seq, p = layout.tp, layout.gas, config.data.seq_length, plan.data.max_predictions
    b = layout.micro_batch_size
    hidden = b * seq * config.model.hidden_size * activation_bytes(config)
    carried = sum(math.prod(batch.shape(k, b, seq, p)) * np.dtype(batch.FIELDS[k].dtype).itemsize
                  for k in PIPE_ACTIVATIONS[1:])
    meta = 8 * (META_ELEMENTS_BASE + tp) if tp > 1 else 0
    part, parts = (hidden // tp, 2) if tp > 1 else (hidden, 1)  # messages of the hidden states
    forward_msgs = parts + len(PIPE_ACTIVATIONS) - 1
    out, gathers = [], 0
    pipe = group_ranks(layout, rank, "PP")
    if stage < layout.pp - 1:  # to the next stage and back
        peer = (rank, pipe[stage + 1])
        out += [Collective("PP", "send", f"activations to stage {stage + 1}",
                           gas * (meta + part + carried), gas * forward_msgs, peer),
                Collective("PP", "recv", f"gradients from stage {stage + 1}",
                           gas * (meta + part), gas * parts, peer)]
        gathers += 2
    if stage > 0:
        peer = (rank, pipe[stage - 1])
        out += [Collective("PP", "recv", f"activations from stage {stage - 1}",
                           gas * (meta + part + carried), gas * forward_msgs, peer),
                Collective("PP", "send", f"gradients to stage {stage - 1}",
                           gas * (meta + part), gas * parts, peer)]
        gathers += 1
    if tp > 1:
        out.append(Collective("TP", "all-gather", "pipeline hidden states from TP parts",
                              gathers * gas * hidden, gathers * gas,
                              group_ranks(layout, rank, "TP")))
    return out


def _dp(config: Config, plan: RunPlan, stage: int, rank: int) -> list[Collective]:
    """Per optimizer step, over this rank's parameters (its TP shard of its stage's layers,
    vocabulary padding included): our buckets with their alignment padding."""
    layout = plan.layout
    if layout.dp == 1:
        return []
    weight, ranks = activation_bytes(config), group_ranks(layout, rank, "DP")
    buckets = stage_buckets(config, plan, stage)
    elements = sum(b.elements for b in buckets)
    reduce = (Collective("DP", "reduce-scatter", "fp32 gradients, bucketed", 4 * elements,
                         len(buckets), ranks, overlap="backward")
              if config.parallel.grad_reduce_dtype == "fp32" else
              Collective("DP", "all-to-all", "bf16 gradients, bucketed, summed in fp32",
                         2 * elements, len(buckets), ranks, overlap="backward"))
    return [reduce,
            Collective("DP", "all-gather", "weights after the ZeRO-1 step", weight * elements,
                       len(buckets), ranks,
                       overlap="forward" if config.parallel.overlap_weight_gather else "none")]


def step_collectives(config: Config, plan: RunPlan, stage: int) -> list[Collective]:
    """Every collective a rank of pipeline stage `stage` makes in one optimizer step, beyond
    scalars (the step's token count, loss statistics and gradient norm: a few calls of 1-2
    elements)."""
    rank = stage_rank(plan.layout, stage)
    bounds = plan.stages.boundaries
    layers = range(bounds[stage], bounds[stage + 1])
    return (_tp(config, plan, layers, rank) + _pp(config, plan, stage, rank)
            + _dp(config, plan, stage, rank))


# -- time at a stated bandwidth and MFU -------------------------------------------------------
@dataclass(frozen=True)
class StageTime:
    """One stage's step at the assumptions: compute, and each collective's exposed seconds."""

    stage: int
    compute_s: float
    collectives: list[Collective]
    exposed_s: list[float]

    @property
    def total_exposed_s(self) -> float:
        return sum(self.exposed_s)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.total_exposed_s


def stage_time(config: Config, plan: RunPlan, stage: int, links: LinkAssumptions) -> StageTime:
    """Compute: the stage's training FLOPs per rank (the stage split's count, recomputation
    included) x micro-batches / (peak x MFU). Exposed: each TP and PP collective's wire bytes
    / bandwidth (all of it); on our DP path, what the step's order leaves the device waiting
    for (training/step_order.py), charged to the kind of collective it waited for."""
    rate = links.peak_flops * links.mfu
    compute = plan.stages.flops[stage] * plan.layout.gas / rate
    collectives = step_collectives(config, plan, stage)
    ranks = group_ranks(plan.layout, stage_rank(plan.layout, stage), "DP")
    bandwidth = links.bytes_per_second(ranks)
    _, waited = simulate(dp_order(
        config, plan, stage, lambda flops: flops / rate,
        lambda op, size: size * wire_factor(op, len(ranks)) / bandwidth))
    exposed = [waited.get(c.op, 0.0) if c.group == "DP" else
               c.wire_bytes / links.bytes_per_second(c.ranks) for c in collectives]
    return StageTime(stage, compute, collectives, exposed)
