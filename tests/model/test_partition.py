"""Pipeline stages balanced by training FLOPs, under a memory cap (model/partition.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rembert.checkpoint.resume import (
    check_layout,
    other_stage_split,
    parameter_balanced_boundaries,
)
from megatron_rembert.checkpoint.step_folder import StepFolder
from megatron_rembert.config import ConfigError
from megatron_rembert.model.partition import balance_stages, one_f_one_b_efficiency
from megatron_rembert.run_config.load import load_config
from megatron_rembert.training.dry_run import dry_run_report
from megatron_rembert.training.estimate import stage_plan
from megatron_rembert.training.plan import RunPlan

ROOT = Path(__file__).resolve().parents[2]


def _rembert(pp: int, *sets: str):
    config = load_config(ROOT / "configs/rembert.yaml", [f"parallel.pp={pp}", *sets])
    return config, RunPlan.build(config, 2 * pp * 4)  # tp 2 x dp 4


@pytest.mark.parametrize("pp, goal", [(2, 0.55), (4, 0.30), (8, 0.15)])
def test_rembert_busiest_stage_meets_the_goal(pp, goal):
    config, run = _rembert(pp)
    plan, layout = run.stages, run.layout
    assert max(plan.flops) / sum(plan.flops) <= goal
    # The parameter balance it replaces missed it: 76% of the FLOPs on stage 0 at pp = 2.
    old = parameter_balanced_boundaries(config, pp)
    per_layer = _layer_flops(config, run)
    old_flops = [sum(per_layer[old[i]:old[i + 1]]) for i in range(pp)]
    assert max(old_flops) / sum(old_flops) > goal
    assert plan.efficiency > one_f_one_b_efficiency(old_flops, layout.gas)


def _layer_flops(config, run):
    from megatron_rembert.model.partition import pipeline_layer_flops

    seq = config.data.seq_length
    return pipeline_layer_flops(config.model, seq, run.data.max_predictions,
                                config.parallel.activation_checkpointing,
                                masked=run.data.training_masked_per_row(seq))


def test_every_layer_once_and_deterministic():
    config, run = _rembert(4, "parallel.activation_checkpointing=true")
    b = run.stages.boundaries
    assert b[0] == 0 and b[-1] == config.model.num_hidden_layers + 2
    assert all(b[i] < b[i + 1] for i in range(4))  # contiguous, non-empty, each layer once
    assert stage_plan(config, run.layout, run.data).boundaries == b


def test_exhaustive_optimum_on_small_cases():
    """The dynamic programme finds the best split of every small case (brute force)."""
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(30):
        n, stages = rng.randint(2, 7), rng.randint(1, 3)
        if stages > n:
            continue
        flops = [float(rng.randint(1, 9)) for _ in range(n)]
        static = [float(rng.randint(1, 9)) for _ in range(n)]
        acts = [float(rng.randint(0, 3)) for _ in range(n)]
        flight = [stages - i for i in range(stages)]
        cap = float(rng.randint(10, 40))
        splits = [[0, *cuts, n] for cuts in itertools.combinations(range(1, n), stages - 1)]
        feasible = [b for b in splits
                    if all(_memory(b, i, static, acts, flight) <= cap for i in range(stages))]
        if not feasible:
            with pytest.raises(ValueError, match="keeps every stage under"):
                balance_stages(flops, static, acts, flight, cap)
            continue
        got = balance_stages(flops, static, acts, flight, cap)
        assert all(_memory(got, i, static, acts, flight) <= cap for i in range(stages))
        assert max(_flops(got, i, flops) for i in range(stages)) == min(
            max(_flops(b, i, flops) for i in range(stages)) for b in feasible)


def _memory(bounds, i, static, acts, flight):
    return sum(static[k] + flight[i] * acts[k] for k in range(bounds[i], bounds[i + 1]))


def _flops(bounds, i, flops):
    return sum(flops[bounds[i]:bounds[i + 1]])


@pytest.mark.multiprocess
def test_memory_cap_moves_layers_off_the_first_stage():
    config, run = _rembert(2)
    free = run.stages
    # The uncapped balance leaves stage 0 (most micro-batches in flight) the most memory.
    cap = 0.9 * max(free.total_memory(i) for i in range(2))
    _, capped_run = _rembert(2, f"parallel.stage_memory_gib={cap / 2**30}")
    capped = capped_run.stages
    assert all(capped.total_memory(i) <= cap for i in range(2))
    assert capped.boundaries[1] < free.boundaries[1]
    # The trainer's own check (before any heavy work) names the key.
    run = subprocess.run([sys.executable, "train.py", "--config", "configs/rembert.yaml",
                          "--set", "parallel.pp=2", "--set", "parallel.stage_memory_gib=1",
                          "--dry-run", "--world-size", "16"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert ("error: parallel.stage_memory_gib=1.0: no split of 34 pipeline layers into 2 "
            "stages") in run.stderr
    with pytest.raises(ConfigError, match="parallel.stage_memory_gib"):
        _rembert(2, "parallel.stage_memory_gib=1")


def test_dry_run_prints_the_stage_table():
    config, run = _rembert(2)
    report = dry_run_report(config, run)
    assert "1F1B efficiency bound" in report
    assert "stage 0: embedding + layers 0-17" in report
    assert "stage 1: layers 18-31 + MLM head" in report


def test_a_checkpoint_of_another_split_is_read_as_full_tensors():
    """Resuming at the same tp x pp but another stage split (a checkpoint of an earlier version
    records none: DeepSpeed's parameter balance) takes the full-tensor path."""
    config, run = _rembert(2)
    layout, current = run.layout, run.stage_boundaries
    old = parameter_balanced_boundaries(config, 2)
    assert old != current
    meta = {"layout": layout.sizes(), "stage_boundaries": current}
    assert other_stage_split(meta, config, layout, current) is None
    assert other_stage_split({"layout": layout.sizes()}, config, layout, current) == old
    assert other_stage_split({**meta, "stage_boundaries": old}, config, layout, current) == old
    one, single = _rembert(1)
    assert single.stage_boundaries is None
    assert other_stage_split({"layout": single.layout.sizes()}, one, single.layout,
                             None) is None
    # How each loads: the same split everything ('same'), another split full tensors; at
    # another dp the split is not consulted (ZeRO partitions load full tensors anyway).
    saved = {"config": {"parallel": {"zero_stage": 1}}}
    for split, how in ((current, "same"), (old, "full")):
        step = StepFolder(Path("step_00000001"), {**meta, **saved, "stage_boundaries": split})
        assert check_layout(step, layout, other_stage_split(step.meta, config, layout,
                                                            current)) == how
    other_dp = {**meta, "layout": {**layout.sizes(), "dp": 1}, "stage_boundaries": old}
    assert other_stage_split(other_dp, config, layout, current) is None
