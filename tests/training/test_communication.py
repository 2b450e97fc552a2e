"""The communication estimate of `--dry-run` (training/communication.py) in one process: the TP
all-reduces against a real forward and backward counted at parallel/mappings.py, the ring
formulas, the DP paths, the overlap rule and the link of each group against hand counts, and
the flags' bad input. The multi-process count of a whole step: test_communication_counted.py."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from megatron_rembert import train
from megatron_rembert.config import get_preset
from megatron_rembert.model.cost import tp_all_reduces
from megatron_rembert.parallel import state
from megatron_rembert.parallel.mappings import ALL_REDUCE_BYTES, ALL_REDUCE_COUNTS
from megatron_rembert.run_config.load import build_config, load_config
from megatron_rembert.training.communication import (
    group_ranks,
    stage_time,
    step_collectives,
    wire_factor,
)
from megatron_rembert.training.dry_run import dry_run_report
from megatron_rembert.training.links import LinkAssumptions
from megatron_rembert.training.plan import RunPlan
from tests.training.helpers import PREDICTIONS, SEQ, micro_batches

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("layers, recompute", [(1, False), (1, True), (2, False)])
def test_tp_all_reduces_equal_those_of_a_real_forward_and_backward(layers, recompute):
    """TP rank 0 of 2, offline (the all-reduces count but move nothing): the bytes and calls
    per tag that one micro-batch's forward and backward issue are the cost model's."""
    config = dataclasses.replace(get_preset("tiny"), num_hidden_layers=layers)
    from megatron_rembert.model.rembert import RemBertForPreTraining

    with state.offline(2):
        model = RemBertForPreTraining(config)
        model.init_weights(1)
        model.rembert.activation_checkpointing = recompute
        mb = micro_batches(0, 2, 2, 0, 1, config.vocab_size)[0]
        del mb["unpadded"]
        ALL_REDUCE_COUNTS.clear()
        ALL_REDUCE_BYTES.clear()
        model(**mb).loss_sum.backward()
    predicted_calls, predicted_bytes = {}, {}
    for layer in tp_all_reduces(config, SEQ, PREDICTIONS, 2, recompute, 4):
        for r in layer:
            predicted_calls[r.tag] = predicted_calls.get(r.tag, 0) + r.calls
            predicted_bytes[r.tag] = predicted_bytes.get(r.tag, 0) + r.calls * r.buffer_bytes
    assert dict(ALL_REDUCE_COUNTS) == predicted_calls
    assert dict(ALL_REDUCE_BYTES) == predicted_bytes
    # and by hand, reading the model (B 2, S 16, E_in 16, H 48, P 4, E_out 24, fp32): the
    # lookup, 2 row-parallel outputs per layer (twice with recomputation), 2 input gradients
    # per layer, the head's input gradient, its loss's max (8 rows) and [sum-exp, target]
    forward = 2 * 16 * 16 * 4 + layers * (4 if recompute else 2) * 2 * 16 * 48 * 4
    backward = layers * 2 * 2 * 16 * 48 * 4 + 2 * 4 * 24 * 4
    assert dict(ALL_REDUCE_BYTES) == {"forward": forward, "backward": backward,
                                      "loss": 8 * 4 + 2 * 8 * 4}


def test_ring_formulas():
    assert [wire_factor("all-reduce", n) for n in (1, 2, 4, 16)] == [0, 1.0, 1.5, 1.875]
    assert [wire_factor("all-gather", n) for n in (1, 2, 4)] == [0, 0.5, 0.75]
    assert wire_factor("reduce-scatter", 8) == 0.875
    assert wire_factor("all-to-all", 4) == 0.75  # a quarter of it stays on the rank
    assert wire_factor("send", 2) == wire_factor("recv", 2) == 1.0
    with pytest.raises(ValueError, match="unknown collective"):
        wire_factor("broadcast", 2)


def _tiny(*sets: str, world: int = 8):
    config = build_config({"model": {"preset": "tiny"}},
                          ["train.micro_batch_size=2", "data.seq_length=16", *sets])
    return config, RunPlan.build(config, world)


def _rank_parameters(config, tp: int) -> int:
    """What one TP rank holds of the whole model (pp = 1), built on the meta device."""
    from megatron_rembert.model.rembert import RemBertForPreTraining

    with state.offline(tp), torch.device("meta"):
        return sum(p.numel() for p in RemBertForPreTraining(config.model).parameters())


def _bucket_elements(config, plan) -> int:
    """Elements of a stage-0 rank's gradient buckets (parameters and their alignment padding),
    as the counted calls of tests/training/test_communication_counted.py confirm."""
    from megatron_rembert.training.step_order import stage_buckets

    return sum(b.elements for b in stage_buckets(config, plan, 0))


def test_dp_bytes_of_the_production_path():
    config, plan = _tiny("parallel.tp=2", "train.global_batch_size=16",
                         "train.precision=bf16")  # dp 4, ZeRO-1 bf16: our gradient buffers
    params, elements = _rank_parameters(config, 2), _bucket_elements(config, plan)
    assert 0 <= elements - params < 64 * 64  # each parameter aligned to 64 elements
    dp = {c.op: c for c in step_collectives(config, plan, 0) if c.group == "DP"}
    assert set(dp) == {"reduce-scatter", "all-gather"}
    assert dp["all-gather"].wire_bytes == 3 / 4 * 2 * elements  # the bf16 weights
    assert dp["reduce-scatter"].wire_bytes == 3 / 4 * 4 * elements  # fp32 gradients
    # at most (n - 1) / n x 6 bytes per parameter on the wire, padding aside
    assert sum(c.wire_bytes for c in dp.values()) <= 3 / 4 * 6 * elements
    assert all(c.size == 4 for c in dp.values())
    # one DP rank: nothing to reduce
    config1, plan1 = _tiny("parallel.tp=2", world=2)
    assert not [c for c in step_collectives(config1, plan1, 0) if c.group == "DP"]


def _dp_exposed(config, plan, links) -> dict:
    t = stage_time(config, plan, 0, links)
    return {c.op: s for c, s in zip(t.collectives, t.exposed_s, strict=True) if c.group == "DP"}


@pytest.mark.parametrize("overlap", [True, False])
def test_one_bucket_hides_nothing(overlap):
    """One bucket: its reduce-scatter starts when the last backward has finished, and the
    first layer's forward waits for its whole all-gather: both fully exposed, with or without
    the overlap (what a per-layer-bucket model would claim hidden is not)."""
    config, plan = _tiny("parallel.tp=2", "train.global_batch_size=16", "train.precision=bf16",
                         f"parallel.overlap_weight_gather={str(overlap).lower()}")
    elements = _bucket_elements(config, plan)
    slow = LinkAssumptions(intra_node_gbps=0.001, inter_node_gbps=0.001, mfu=0.5)
    exposed = _dp_exposed(config, plan, slow)
    assert exposed["reduce-scatter"] == pytest.approx(3 / 4 * 4 * elements / (0.001e9 / 8))
    assert exposed["all-gather"] == pytest.approx(3 / 4 * 2 * elements / (0.001e9 / 8))
    t = stage_time(config, plan, 0, slow)
    assert t.compute_s == pytest.approx(plan.stages.flops[0] * plan.layout.gas / (
        slow.peak_flops * 0.5))
    fast = _dp_exposed(config, plan, LinkAssumptions(intra_node_gbps=1e9))
    assert max(fast.values()) < 1e-9  # what is left: one bucket's time on a fast link


def test_buckets_hide_what_the_order_lets_them():
    """Buckets of 3,000 elements: the all-gather's buckets after the first hide behind the
    forward, the reduce-scatters behind the backward, as far as compute lasts; without the
    overlap the all-gather is all exposed."""
    from megatron_rembert.training.step_order import stage_buckets

    sets = ("parallel.tp=2", "train.global_batch_size=16", "train.precision=bf16",
            "parallel.grad_bucket_elements=3000")
    config, plan = _tiny(*sets)
    buckets = stage_buckets(config, plan, 0)
    assert len(buckets) > 3
    links = LinkAssumptions(intra_node_gbps=0.0005, inter_node_gbps=0.0005, mfu=0.5)
    bandwidth = 0.0005e9 / 8
    full = {"all-gather": sum(3 / 4 * 2 * b.elements for b in buckets) / bandwidth,
            "reduce-scatter": sum(3 / 4 * 4 * b.elements for b in buckets) / bandwidth}
    overlapped = _dp_exposed(config, plan, links)
    first = 3 / 4 * 2 * buckets[-1].elements / bandwidth  # the embedding's bucket
    assert first < overlapped["all-gather"] < full["all-gather"]
    last = 3 / 4 * 4 * buckets[-1].elements / bandwidth  # issued after the whole backward
    assert last < overlapped["reduce-scatter"] < full["reduce-scatter"]
    waiting, _ = _tiny(*sets, "parallel.overlap_weight_gather=false")
    assert _dp_exposed(waiting, plan, links)["all-gather"] == pytest.approx(full["all-gather"])


def test_a_blocking_collective_behind_the_gather_exposes_all_of_it():
    """NCCL's queue: a blocking all-reduce issued on the group behind the in-flight all-gathers
    (the order before the statistics moved) waits for all of them; issued before them, for
    nothing."""
    from megatron_rembert.training.step_order import Event, simulate

    gathers = [Event("issue", "all-gather", 2.0, key=k) for k in range(3)]
    waits = [Event("wait", "all-gather", key=k) for k in range(3)]
    forward = [Event("compute", seconds=3.0)] * 3
    good = [Event("blocking", "all-reduce"), *gathers,
            *[e for pair in zip(waits, forward, strict=True) for e in pair]]
    seconds, exposed = simulate(good)
    assert exposed == {"all-gather": 2.0} and seconds == 11.0  # the first bucket only
    bad = [*gathers, Event("blocking", "all-reduce"),
           *[e for pair in zip(waits, forward, strict=True) for e in pair]]
    seconds, exposed = simulate(bad)
    assert exposed == {"all-gather": 6.0} and seconds == 15.0  # all of it


def test_pipeline_messages_at_tp_1():
    """DeepSpeed's engine at tp = 1: the hidden states and the int masks, positions, labels and
    weights forward, the hidden states' gradient back; per micro-batch."""
    config, plan = _tiny("parallel.pp=2", "train.global_batch_size=6", world=2)
    b, s, h, p, gas = 2, 16, 48, plan.data.max_predictions, 3
    hidden = b * s * h * 2  # bf16, the default precision
    carried = b * s * 8 + 2 * b * p * 8 + b * p * 4  # mask, positions, labels int64; weights
    first = {c.op: c for c in step_collectives(config, plan, 0)}
    last = {c.op: c for c in step_collectives(config, plan, 1)}
    assert set(first) == set(last) == {"send", "recv"}  # no TP, no DP
    assert (first["send"].buffer_bytes, first["send"].calls) == (gas * (hidden + carried), 15)
    assert (first["recv"].buffer_bytes, first["recv"].calls) == (gas * hidden, gas)
    assert last["recv"].buffer_bytes == first["send"].buffer_bytes
    assert last["send"].buffer_bytes == first["recv"].buffer_bytes
    assert first["send"].ranks == (0, 1) and last["send"].ranks == (1, 0)


def test_which_groups_cross_nodes():
    config = load_config(ROOT / "configs/rembert.yaml", ["parallel.pp=2"])
    plan = RunPlan.build(config, 64)  # tp 2 x dp 16 x pp 2
    links = LinkAssumptions()  # 8 GPUs per node
    assert group_ranks(plan.layout, 0, "TP") == (0, 1)
    assert group_ranks(plan.layout, 0, "DP") == tuple(range(0, 32, 2))
    assert group_ranks(plan.layout, 0, "PP") == (0, 32)
    kinds = {(c.group, links.inter_node(c.ranks)) for c in step_collectives(config, plan, 0)}
    assert kinds == {("TP", False), ("PP", True), ("DP", True)}
    small = RunPlan.build(config, 16)  # tp 2 x dp 4 x pp 2: a DP group fits in a node
    kinds = {(c.group, links.inter_node(c.ranks)) for c in step_collectives(config, small, 1)}
    assert kinds == {("TP", False), ("PP", True), ("DP", False)}


def test_the_report_of_a_multi_node_run():
    config = load_config(ROOT / "configs/rembert.yaml", ["parallel.pp=2"])
    plan = RunPlan.build(config, 64)
    links = LinkAssumptions(inter_node_gbps=200, mfu=0.5)
    report = dry_run_report(config, plan, links)
    assert "200 Gb/s across nodes" in report and "50% of the H100's 989 TFLOP/s" in report
    assert "DP gradient path: our buckets" in report
    times = [stage_time(config, plan, i, links) for i in range(2)]
    busiest = max(times, key=lambda t: t.step_s)
    rows = report.split(f"stage {busiest.stage}, the longest step:")[1].split("\ncompute")[0]
    exposed = [float(line.split()[-1].replace(",", "")) for line in rows.strip().splitlines()[2:]]
    assert len(exposed) == len(busiest.collectives)
    total = f"{busiest.total_exposed_s * 1e3:,.1f} ms = " \
            f"{busiest.total_exposed_s / busiest.step_s:.1%} of the step"
    assert total in report
    assert sum(exposed) == pytest.approx(busiest.total_exposed_s * 1e3, abs=0.01 * len(exposed))
    for t in times:
        dp = sum(c.wire_bytes for c in t.collectives if c.group == "DP")
        assert f"stage {t.stage}: compute {t.compute_s * 1e3:,.1f} ms; TP " in report
        assert f"DP {dp / 2**30:,.2f} GiB" in report
    assert math.isclose(busiest.step_s, busiest.compute_s + sum(busiest.exposed_s))


def test_fp16_takes_the_same_path():
    config, plan = _tiny("train.precision=fp16", "train.global_batch_size=8", world=4)
    dp = {c.op: c for c in step_collectives(config, plan, 0) if c.group == "DP"}
    assert set(dp) == {"reduce-scatter", "all-gather"}
    assert dp["all-gather"].buffer_bytes * 2 == dp["reduce-scatter"].buffer_bytes  # fp16 weights
    assert "DP gradient path: our buckets" in dry_run_report(config, plan)


def test_one_rank_has_nothing_to_communicate():
    config, plan = _tiny(world=1)
    assert step_collectives(config, plan, 0) == []
    assert "none: one rank per stage" in dry_run_report(config, plan)


@pytest.mark.parametrize("flags, message", [
    (["--assume-mfu", "1.5"], "error: --assume-mfu 1.5: must be in (0, 1]"),
    (["--assume-mfu", "0"], "error: --assume-mfu 0: must be in (0, 1]"),
    (["--inter-node-gbps", "-1"], "error: --inter-node-gbps -1: must be a bandwidth > 0"),
    (["--intra-node-gbps", "nan"], "error: --intra-node-gbps nan: must be a bandwidth > 0"),
    (["--gpus-per-node", "0"], "error: --gpus-per-node 0: must be >= 1"),
    (["--gpu", "V100"], "error: --gpu V100: one of A100, H100, H200"),
])
def test_bad_assumptions_name_the_flag(flags, message, capsys):
    code = train.main(["--config", str(ROOT / "configs/tiny.yaml"), "--dry-run", *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(message) and len(err.strip().splitlines()) == 1


def test_assumptions_need_the_dry_run(capsys):
    code = train.main(["--config", str(ROOT / "configs/tiny.yaml"), "--gpus-per-node", "4"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --gpus-per-node: only with --dry-run")
    assert len(err.strip().splitlines()) == 1
