"""Pipeline stages balanced by compute, each kept under a memory cap.

A 1F1B pipeline runs at the pace of its slowest stage, so stages are balanced by the training
FLOPs of their layers, not by their parameters: RemBERT's 418M-parameter MLM head holds as
many parameters as ~26 Transformer layers but runs only on the masked slots of a sequence,
about 5 layers' worth of compute with the loss's recomputation in backward.

Everything here is a pure function of per-layer numbers: `training.estimate` turns a config
into those numbers (FLOPs and parameters from the cost model, model/cost.py), and the run plan
(training/plan.py) keeps the boundaries it returns for the trainer, the checkpoint metadata
and `--dry-run`.
"""

from __future__ import annotations

# The per-layer FLOPs the split balances come from the cost model; importable here as before.
from megatron_rembert.model.cost import pipeline_layer_flops  # noqa: F401


def balance_stages(flops: list[float], static_bytes: list[float], activation_bytes: list[float],
                   in_flight: list[int], memory_cap: float | None = None,
                   transient_bytes: list[float] | None = None) -> list[int]:
    """Contiguous split of the layers into len(in_flight) non-empty stages that minimises the
    busiest stage's FLOPs (then, among equals, its memory), every stage under `memory_cap`.

    Per layer: `flops`, `static_bytes` (weights, gradients, optimizer states) and
    `activation_bytes` (one micro-batch). Stage i keeps `in_flight[i]` micro-batches of
    activations (1F1B: min(pp - i, accumulation steps)); `transient_bytes`, one buffer per layer
    of which a stage holds the largest at a time (a parameter's fresh gradient, or a layer's
    weights copied for a checkpoint). Returns
    the boundaries
    [0, b1, ..., len(flops)]: stage i owns layers [b_i, b_i+1), DeepSpeed's `parts`.
    Exact (dynamic programming over stages x split points), so deterministic.
    """
    n, stages = len(flops), len(in_flight)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} pipeline layers into {stages} non-empty stages")

    def prefix(xs: list[float]) -> list[float]:
        out = [0.0]
        for x in xs:
            out.append(out[-1] + x)
        return out

    pf, ps, pa = prefix(flops), prefix(static_bytes), prefix(activation_bytes)

    transient = transient_bytes or [0.0] * n

    def stage_cost(i: int, start: int, stop: int) -> tuple[float, float]:
        memory = ps[stop] - ps[start] + in_flight[i] * (pa[stop] - pa[start]) + \
            max(transient[start:stop])
        return pf[stop] - pf[start], memory

    inf = (float("inf"), float("inf"))
    # best[i][j]: the smallest (max FLOPs, max memory) placing layers [0, j) in stages 0..i
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for i in range(stages):
        for j in range(i + 1, n - (stages - 1 - i) + 1):
            for start in range(i, j):  # stage i owns [start, j)
                before = (0.0, 0.0) if i == 0 else best[i - 1][start]
                if i == 0 and start > 0 or before == inf:
                    continue
                cost = stage_cost(i, start, j)
                if memory_cap is not None and cost[1] > memory_cap:
                    continue
                candidate = max(before, cost)
                if candidate < best[i][j]:
                    best[i][j], cut[i][j] = candidate, start
    if best[-1][n] == inf:
        largest = max(s + min(in_flight) * a + t
                      for s, a, t in zip(static_bytes, activation_bytes, transient, strict=True))
        raise ValueError(
            f"no split of {n} pipeline layers into {stages} stages keeps every stage under "
            f"{memory_cap / 2**30:.2f} GiB (the largest layer alone needs at least "
            f"{largest / 2**30:.2f} GiB); use more pipeline or tensor-parallel ranks, a higher "
            "ZeRO stage or activation checkpointing")
    bounds = [n]
    for i in range(stages - 1, 0, -1):
        bounds.append(cut[i][bounds[-1]])
    return [0, *reversed(bounds)]


def one_f_one_b_efficiency(stage_flops: list[float], micro_batches: int) -> float:
    """Upper bound on a 1F1B pipeline's efficiency (useful work / stages x step time), from
    compute alone: a step takes at least (m - 1) slowest-stage slots plus one pass through all
    stages (fill and drain), i.e. m / (m + p - 1) when the stages are equal."""
    p, total, slowest = len(stage_flops), sum(stage_flops), max(stage_flops)
    return micro_batches * total / (p * ((micro_batches - 1) * slowest + total))
