"""The order of the collectives a training step issues, per process group, holds on NCCL: no
blocking collective on a group, and no host read, while an asynchronous all-gather or
reduce-scatter on it is unwaited (tests/training/issue_order.py says why). Recorded on every rank
of real steps: the trainer's at pp 1 and pp 2 (validation included), and train.py's loop with
its signal agreement, validation and a checkpoint save. The weights' all-gather is overlapped
with the forward in every case (parallel.overlap_weight_gather, the default), and the recorded
order shows it: issued, then waited for during the forward."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.training.helpers import GLOBAL_BATCH, MICRO, micro_batches
from tests.training.issue_order import violations

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def _named_groups(recorder, s) -> None:
    import torch.distributed as dist

    for label, group in (("TP", s.tp_group), ("DP", s.dp_group), ("PP", s.pp_group),
                         ("model", s.model_group), ("world", dist.group.WORLD)):
        if group is not None:
            recorder.name(group, label)


def trainer_worker(rank, world_size, overrides: list[str], steps: int = 3) -> list:
    """`steps` training steps, a validation step, one more training step of the tiny model and
    the wait for its weights: the events of each, as (phase, events)."""
    import deepspeed
    import torch

    from megatron_rembert.parallel import state
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.plan import RunPlan
    from tests.training.issue_order import record

    recorder = record()
    deepspeed.init_distributed(dist_backend="gloo")
    config = build_config({"model": {"preset": "tiny"}}, overrides)
    plan = RunPlan.build(config, world_size, rank)
    s = state.initialize_model_parallel(plan.layout)
    _named_groups(recorder, s)
    trainer = Trainer(config, plan, torch.device("cpu"))
    phases = []

    def run(phase, step):
        recorder.clear()
        batches = micro_batches(step, GLOBAL_BATCH, MICRO, s.dp_rank, plan.layout.dp,
                                config.model.vocab_size)
        (trainer.train_step if phase == "train" else trainer.eval_step)(batches)
        phases.append((phase, list(recorder.events)))

    for step in range(steps):
        run("train", step)
    run("eval", steps)
    run("train", steps + 1)
    recorder.clear()
    trainer.wait_for_weights()
    phases.append(("end", list(recorder.events)))
    return phases


def _overrides(pp: int, precision: str, **extra) -> list[str]:
    values = {"parallel.tp": 1, "parallel.pp": pp, "train.precision": precision,
              "train.global_batch_size": GLOBAL_BATCH, "train.micro_batch_size": MICRO,
              "train.steps": 5, "data.seq_length": 16, "parallel.grad_bucket_elements": 4000,
              **extra}
    return [f"{k}={v}" for k, v in values.items()]


def _all_gathers_overlapped(events) -> None:
    """Every DP all-gather was issued asynchronously and waited for later, with forward work
    (other groups' collectives or none) allowed in between: the order the cost model assumes
    (training/communication.py)."""
    gathers = [e for e in events if e.group == "DP" and e.op == "all-gather"]
    assert gathers and all(e.kind in ("issue", "wait") for e in gathers), gathers
    assert sum(e.kind == "issue" for e in gathers) == sum(e.kind == "wait" for e in gathers)


@pytest.mark.parametrize("pp, precision, extra", [
    (1, "bf16", {}),
    (1, "fp32", {"parallel.overlap_weight_gather": "false"}),
    (2, "bf16", {"parallel.grad_reduce_dtype": "bf16"}),
])
def test_no_blocking_collective_or_host_read_behind_an_async_one(pp, precision, extra):
    """Every rank's order holds NCCL's rule, and its DP group's calls in a training step are
    the order the cost model exposes time from (training/step_order.py)."""
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training.plan import RunPlan
    from megatron_rembert.training.step_order import dp_order, sequence

    world = 2 * pp
    overrides = _overrides(pp, precision, **extra)
    per_rank = run_distributed(trainer_worker, world, overrides, timeout=300)
    config = build_config({"model": {"preset": "tiny"}}, overrides)
    for rank, phases in enumerate(per_rank):
        # the first step also sends DeepSpeed's one-time tensor shapes between stages
        events = [e for _, step in phases[1:] for e in step]
        assert violations(events) == [], f"rank {rank}"
        if config.parallel.overlap_weight_gather:
            _all_gathers_overlapped(events)
        plan = RunPlan.build(config, world, rank)
        stage = rank // (plan.layout.dp * plan.layout.tp)
        modelled = sequence(dp_order(config, plan, stage, lambda f: 0.0, lambda op, b: 0.0))
        steady = [step for (before, _), (phase, step) in zip(phases, phases[1:], strict=False)
                  if before == phase == "train"]  # after a validation, nothing to gather
        assert len(steady) == 2
        for step in steady:
            assert [(e.kind, e.op) for e in step if e.group == "DP"] == modelled, rank


def loop_worker(rank, world_size, sets: list[str]) -> list:
    """train.py's loop (configs/tiny.yaml): every event of the run."""
    from megatron_rembert.parallel import state
    from megatron_rembert.run_config.load import load_config
    from megatron_rembert.training import loop
    from tests.training.issue_order import record

    recorder = record()
    real = state.initialize_model_parallel

    def initialize(layout):  # name the groups as they are made
        made = real(layout)
        _named_groups(recorder, made)
        return made

    state.initialize_model_parallel = initialize
    loop.train(load_config("configs/tiny.yaml", sets))
    return recorder.events


def test_train_py_loop_keeps_the_rule(tmp_path, tiny_dataset):
    """The loop users run, bf16 at dp 2: steps with their statistics, the stop-signal
    agreement at each step boundary, validation and background checkpoint saves between
    them; every weights' all-gather still overlapped with a forward."""
    from tests.training.test_loop import overrides

    sets = overrides(tmp_path, *tiny_dataset, **{
        "train.precision": "bf16",
        "train.steps": 5, "train.eval_interval": 2, "train.save_interval": 2,
        "train.async_save": "true", "parallel.grad_bucket_elements": 20000})
    for rank, events in enumerate(run_distributed(loop_worker, 2, sets, timeout=300)):
        assert violations(events) == [], f"rank {rank}"
        _all_gathers_overlapped(events)


def test_the_rule_catches_a_blocking_collective_behind_the_gather():
    """The control: the statistics all-reduced on the DP group after the step, while the
    weights' all-gathers it left are in flight (the order before this rule was enforced)."""
    from tests.training.issue_order import Event

    events = [Event("issue", "all-gather", "DP", 1), Event("blocking", "all-reduce", "DP", 2),
              Event("read", "tolist", "", 0), Event("wait", "all-gather", "DP", 1),
              Event("blocking", "all-reduce", "world", 3)]
    found = violations(events)
    assert len(found) == 2 and "blocking all-reduce on group DP" in found[0]
    assert "host read (tolist)" in found[1]
    assert violations([events[0], events[4], events[3]]) == []  # another group: its own queue
