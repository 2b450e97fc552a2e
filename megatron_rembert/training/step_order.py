"""The data-parallel (DP) group's collectives in one optimizer step, in the order the trainer
issues and waits for them, and the time that order exposes.

NCCL runs the operations of one communicator in the order they were issued: a collective
issued on a group starts when the group's earlier ones are done, and a blocking collective (or
a host read of its result) issued while an asynchronous one on the same group is unwaited waits
for it. So what a step exposes of its communication is a property of the order, not of each
collective alone: `simulate` runs a step's events on one clock for the device and one queue
per group, and charges every second the device spends waiting to the collective it waited for.

The order of a steady-state step on a rank of pipeline stage s, dp > 1 (`dp_order`; the
trainer, training/engine.py, and the optimizer, training/distributed_optimizer.py, issue it so,
and tests/training/test_issue_order.py compares it with every DP call of real steps):
1. the step's masked-token count: a blocking all-reduce (no collective in flight);
2. parallel.overlap_weight_gather (the default): the last step's weights, one asynchronous
   all-gather per bucket, in forward order;
3. the stage's first forward, which waits for each bucket when it reaches the bucket's layers;
4. the rest of the micro-batches' forward and backward passes; during the last backward each
   bucket's reduce-scatter (an all-to-all with parallel.grad_reduce_dtype=bf16) is issued as
   soon as its gradients are complete, in bucket order (the last layers first);
5. the step: a wait for every bucket; the gradient norm's blocking all-reduce; without the
   overlap, the weights' all-gathers issued and waited for here;
6. the step's statistics: a blocking all-reduce. (At pp > 1 DeepSpeed's pipeline engine
   all-reduces the step's loss on the last stage before, over its own process group of the
   same ranks: another communicator, with a queue of its own.)
Scalars take no time in this bandwidth-only model, but they keep their place in the queue.
Compute: a bucket's share of its layers' FLOPs (by parameters), a forward a third of training
(a quarter with activation checkpointing: the layer's forward runs twice); the pipeline's fill
and drain are not counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from megatron_rembert.model.cost import parameter_table
from megatron_rembert.parallel.grad_buffer import lay_out
from megatron_rembert.run_config.schema import Config
from megatron_rembert.training.plan import RunPlan


@dataclass(frozen=True)
class Event:
    kind: str  # "compute", "issue" (asynchronous), "wait" (for an issue), "blocking"
    op: str = ""  # the collective; "" for compute
    seconds: float = 0.0  # compute time, or the collective's time on the wire
    key: int = -1  # the issue a wait belongs to
    group: str = "DP"


@dataclass(frozen=True)
class BucketCost:
    """One gradient bucket of a stage's rank: its elements (alignment padding included) and
    the training FLOPs per micro-batch of the parameters in it."""

    elements: int
    flops: float


def stage_buckets(config: Config, plan: RunPlan, stage: int) -> list[BucketCost]:
    """The gradient buckets of a rank of `stage`, in bucket order (parallel/grad_buffer.py's
    layout of its parameters, in reverse registration order: the last layers first)."""
    bounds = plan.stages.boundaries
    table = [p for p in parameter_table(config.model, plan.layout.tp)
             if bounds[stage] <= p.layer < bounds[stage + 1]][::-1]
    per_layer = Counter()
    for p in table:
        per_layer[p.layer] += p.local
    _, buckets = lay_out([p.local for p in table], config.parallel.grad_bucket_elements,
                         plan.layout.dp)
    flops = plan.stages.layer_flops
    return [BucketCost(end - start, sum(flops[p.layer] * p.local / per_layer[p.layer]
                                        for p in table[first:last]))
            for first, last, start, end in buckets]


def dp_order(config: Config, plan: RunPlan, stage: int,
             compute_seconds: Callable[[float], float],
             wire_seconds: Callable[[str, int], float]) -> list[Event]:
    """The events of one step on a rank of `stage` (see the module docstring), [] at dp = 1.
    `compute_seconds(flops)`; `wire_seconds(op, buffer_bytes)` of one collective."""
    layout, par = plan.layout, config.parallel
    if layout.dp == 1:
        return []
    buckets = stage_buckets(config, plan, stage)
    forward = 1 / 4 if par.activation_checkpointing else 1 / 3
    weight_bytes = 2 if config.train.precision in ("bf16", "fp16") else 4
    reduce = (("reduce-scatter", 4) if par.grad_reduce_dtype == "fp32" else ("all-to-all", 2))
    overlap = par.overlap_weight_gather
    n = len(buckets)
    gather = [Event("issue", "all-gather", wire_seconds("all-gather", weight_bytes * b.elements),
                    key=i) for i, b in enumerate(buckets)]
    order = [Event("blocking", "all-reduce")]  # the step's masked tokens
    if overlap:
        order += gather[::-1]  # forward order: the first layers' bucket first
    for i in reversed(range(n)):  # the first forward
        if overlap:
            order.append(Event("wait", "all-gather", key=i))
        order.append(Event("compute", seconds=compute_seconds(forward * buckets[i].flops)))
    total = sum(b.flops for b in buckets)
    order.append(Event("compute", seconds=compute_seconds((layout.gas - 1) * total)))
    for i, b in enumerate(buckets):  # the last backward
        order += [Event("compute", seconds=compute_seconds((1 - forward) * b.flops)),
                  Event("issue", reduce[0], wire_seconds(reduce[0], reduce[1] * b.elements),
                        key=n + i)]
    order += [Event("wait", reduce[0], key=n + i) for i in range(n)]
    order.append(Event("blocking", "all-reduce"))  # the gradient norm
    if not overlap:
        order += gather[::-1] + [Event("wait", "all-gather", key=i) for i in reversed(range(n))]
    order.append(Event("blocking", "all-reduce"))  # the step's statistics
    return order


def sequence(order: list[Event]) -> list[tuple[str, str]]:
    """The (kind, op) of the collectives, in order: what a recording of real calls shows."""
    return [(e.kind, e.op) for e in order if e.kind != "compute"]


def simulate(order: list[Event]) -> tuple[float, Counter]:
    """Run `order`: compute advances the clock; an issued collective starts when its group's
    earlier ones are done, the clock going on; a wait moves the clock to its collective's end;
    a blocking collective waits for its group's queue, then for itself. Returns the step's
    seconds and the seconds the device waited, by the collective waited for."""
    now, exposed = 0.0, Counter()
    queue: dict[str, list[tuple[float, str, int]]] = {}  # group -> (end, op, key) in flight
    ends: dict[int, float] = {}

    def wait_until(end: float, op: str) -> None:
        nonlocal now
        if end > now:
            exposed[op] += end - now
            now = end

    for e in order:
        if e.kind == "compute":
            now += e.seconds
        elif e.kind == "issue":
            in_flight = queue.setdefault(e.group, [])
            end = max([now] + [t for t, _, _ in in_flight]) + e.seconds
            in_flight.append((end, e.op, e.key))
            ends[e.key] = end
        elif e.kind == "wait":
            wait_until(ends[e.key], e.op)
        elif e.kind == "blocking":
            for end, op, _ in sorted(queue.pop(e.group, [])):  # charged to what it waited for
                wait_until(end, op)
            wait_until(now + e.seconds, e.op)
        else:
            raise ValueError(f"unknown event kind {e.kind!r}")
    return now, exposed
