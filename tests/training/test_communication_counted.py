"""`--dry-run`'s communication per step (training/communication.py) against the collectives a
real training step makes: every torch.distributed call of one step on every rank, counted by
wrapping torch.distributed's functions in the worker (DeepSpeed's pipeline engine and its ZeRO-1
all-gather call them directly, not through parallel/comm.py), classified by group. Where the
report hides the DP reduce-scatter behind the last backward (pp 1 and 2), the trainer's step
left at most one bucket to start at the step."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.distributed import run_distributed
from tests.training.helpers import GLOBAL_BATCH, MICRO, layout_overrides, micro_batches

pytestmark = pytest.mark.multiprocess  # every test here starts processes

OPS = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather",
       "all_gather_single": "all-gather", "reduce_scatter_single": "reduce-scatter",
       "all_gather": "all-gather", "reduce_scatter_tensor": "reduce-scatter",
       "broadcast": "broadcast", "send": "send", "recv": "recv", "isend": "send",
       "irecv": "recv", "all_to_all_single": "all-to-all"}
SCALAR_ELEMENTS = 2  # the step's token count, loss statistics, gradient norm, DeepSpeed's loss


def _bytes(name: str, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(elements, bytes) of a call's buffer: the whole gathered tensor for an all-gather."""
    import torch

    if name == "all_gather":
        tensors = args[0] if args else kwargs["tensor_list"]
    elif name in ("all_gather_into_tensor", "all_gather_single"):
        tensors = [args[0] if args else kwargs["output_tensor"]]
    elif name == "all_to_all_single":  # the tensor sent
        tensors = [args[1] if len(args) > 1 else kwargs["input"]]
    elif name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        tensors = [args[1] if len(args) > 1 else kwargs["input"]]
    else:
        tensors = [args[0] if args else kwargs["tensor"]]
    assert all(isinstance(t, torch.Tensor) for t in tensors)
    return (sum(t.numel() for t in tensors),
            sum(t.numel() * t.element_size() for t in tensors))


def _count_calls(calls: list) -> None:
    """Wrap torch.distributed's collectives: each call appends (name, group ranks or peer,
    elements, bytes) to `calls`. Before DeepSpeed binds them (deepspeed.init_distributed)."""
    import torch.distributed as dist

    def wrap(name, fn):
        def counted(*args, **kwargs):
            elements, size = _bytes(name, args, kwargs)
            if name in ("send", "isend", "recv", "irecv"):
                peer = kwargs.get("dst", kwargs.get("src"))
                peer = args[1] if peer is None else peer
                who = ("peer", peer)
            else:
                group = kwargs.get("group")
                if group is None:
                    positional = {"all_reduce": 2, "broadcast": 2, "all_gather": 2,
                                  "all_gather_into_tensor": 2, "all_gather_single": 2,
                                  "reduce_scatter_tensor": 3, "reduce_scatter_single": 3}
                    index = positional[name]
                    group = args[index] if len(args) > index else None
                who = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            calls.append((name, who, elements, size))
            return fn(*args, **kwargs)
        return counted

    for name in OPS:
        setattr(dist, name, wrap(name, getattr(dist, name)))


def counting_worker(rank: int, world_size: int, overrides: list[str]):
    """Two training steps of the tiny model; the calls of the second (the first also sends
    DeepSpeed's one-time tensor shapes between stages)."""
    import deepspeed
    import torch

    from megatron_rembert.parallel import state
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.plan import RunPlan

    calls: list = []
    _count_calls(calls)
    deepspeed.init_distributed(dist_backend="gloo")
    config = build_config({"model": {"preset": "tiny"}}, overrides)
    plan = RunPlan.build(config, world_size, rank)
    s = state.initialize_model_parallel(plan.layout)
    trainer = Trainer(config, plan, torch.device("cpu"))
    groups = {kind: tuple(torch.distributed.get_process_group_ranks(g))
              for kind, g in (("TP", s.tp_group), ("DP", s.dp_group), ("PP", s.pp_group))}
    for step in range(2):
        batches = micro_batches(step, GLOBAL_BATCH, MICRO, s.dp_rank, plan.layout.dp,
                                config.model.vocab_size)
        del calls[:]
        trainer.train_step([_widened(mb, plan.data.max_predictions) for mb in batches])
    buffer = trainer.grad_buffer  # buckets, and those the step started (not backward)
    started = (len(buffer.buckets), buffer.started_in_finish) if buffer else None
    return list(calls), groups, started


def _widened(mb: dict, predictions: int) -> dict:
    """The micro-batch with P = `predictions` masked slots, as the loader makes them for the
    plan (the synthetic samples have fewer); the added slots are padding (weight 0)."""
    import torch.nn.functional as F

    return {k: F.pad(v, (0, predictions - v.shape[1])) if k.startswith("masked_") else v
            for k, v in mb.items()}


def _classify(calls: list, groups: dict) -> tuple[Counter, Counter, list]:
    """Counted calls by (group, op): calls and bytes; the scalar calls apart."""
    n, size, scalars = Counter(), Counter(), []
    for name, who, elements, nbytes in calls:
        if elements <= SCALAR_ELEMENTS:
            scalars.append((name, who, nbytes))
            continue
        if who[0] == "peer":
            kind = "PP" if who[1] in groups["PP"] else f"peer {who[1]}"
        else:
            kind = next((k for k, ranks in groups.items() if ranks == who), f"group {who}")
        n[kind, OPS[name]] += 1
        size[kind, OPS[name]] += nbytes
    return n, size, scalars


@pytest.mark.parametrize("tp, pp, dp, recompute, layers, precision, bucket, wire", [
    # every group, both pipeline ends, recomputation's forward all-reduces; bf16 activations
    # and weights, fp32 main gradients in buckets of 5,000 elements (several per stage): the
    # production path
    (2, 2, 2, True, 2, "bf16", 5000, "fp32"),
    (2, 3, 1, False, 3, "fp32", 40_000_000, "fp32"),  # a middle stage: activations, gradients
    (1, 1, 2, False, 2, "fp32", 3000, "fp32"),  # pp = 1: the buckets start during backward
    (1, 1, 2, False, 2, "bf16", 3000, "bf16"),  # bf16 on the wire: an all-to-all per bucket
])
def test_dry_run_bytes_equal_the_counted_collectives(tp, pp, dp, recompute, layers, precision,
                                                     bucket, wire):
    from megatron_rembert.parallel.layout import layout_coords
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training.communication import group_ranks, step_collectives
    from megatron_rembert.training.plan import RunPlan

    overrides = layout_overrides(tp, pp, recompute, **{
        "model.num_hidden_layers": layers, "train.precision": precision,
        "parallel.grad_bucket_elements": bucket, "parallel.grad_reduce_dtype": wire})
    config = build_config({"model": {"preset": "tiny"}}, overrides)
    results = run_distributed(counting_worker, tp * pp * dp, overrides, timeout=500)
    for rank, (calls, groups, started) in enumerate(results):
        plan = RunPlan.build(config, tp * pp * dp, rank)
        for kind in groups:  # the report's groups are the trainer's
            assert group_ranks(plan.layout, rank, kind) == groups[kind], (rank, kind)
        stage = layout_coords(rank, dp, tp)[0]
        counted_calls, counted_bytes, scalars = _classify(calls, groups)
        predicted_calls, predicted_bytes = Counter(), Counter()
        for c in step_collectives(config, plan, stage):
            predicted_calls[c.group, c.op] += c.calls
            predicted_bytes[c.group, c.op] += c.buffer_bytes
        assert counted_bytes.keys() == predicted_bytes.keys(), rank
        if dp > 1:  # the reduce-scatters the report hides behind the last backward start there
            scatter = [c for c in step_collectives(config, plan, stage)
                       if c.op == ("reduce-scatter" if wire == "fp32" else "all-to-all")]
            assert [c.overlap for c in scatter] == ["backward"]
            buckets, at_step = started
            assert buckets == scatter[0].calls and at_step <= 1, (rank, started)
        for key, nbytes in predicted_bytes.items():
            assert counted_calls[key] == predicted_calls[key], (rank, key)
            assert counted_bytes[key] == nbytes, (rank, key)
        # what the report leaves out: a few scalars per step (the step's token count; the loss
        # statistics over DP and PP; the gradient norm over DP and the model-parallel group;
        # DeepSpeed's loss broadcast between pipeline ends)
        assert len(scalars) <= 7 and all(nbytes <= 16 for *_, nbytes in scalars), scalars
