"""Small parts of the run's start and end: the time limit's flag, the run average, DeepSpeed's
routine output kept off the console."""

from __future__ import annotations

import io
import os
import signal

import pytest

from megatron_rembert.deepspeed_env import choose_accelerator, routine_lines_dropped
from megatron_rembert.training.metrics import RunAverage
from megatron_rembert.training.signals import StopFlag


def test_time_limit_counts_only_at_step_boundaries_and_says_so():
    stop = StopFlag()
    try:
        stop.set_time_limit(1e-9)  # passed already
        assert not stop.agreed()  # start-up's agreement ignores the limit
        assert stop.agreed(time_limit=True) and stop.time_limit_reached and not stop.raised
        stop.set_time_limit(0)  # off
        assert not stop.agreed(time_limit=True) and not stop.time_limit_reached
        stop.set_time_limit(60)  # an hour from the process's start: far off
        assert not stop.agreed(time_limit=True)
        signal.raise_signal(signal.SIGUSR1)
        assert stop.agreed(time_limit=True) and not stop.time_limit_reached
    finally:
        stop.restore()


def test_run_average_leaves_out_the_first_step():
    average = RunAverage(world_size=2, peak=100e12)
    assert average.values() == {}
    average.add(5, tokens=1000, flops=9e12, seconds=50.0)  # the warm-up: left out
    assert average.values() == {} and "needs two steps" in average.line()
    average.add(6, tokens=1000, flops=4e12, seconds=1.0)
    average.add(7, tokens=3000, flops=8e12, seconds=3.0)
    v = average.values()
    assert v["steps"] == 2 and v["first_step"] == 6
    assert v["tokens_per_s"] == pytest.approx(4000 / 4.0)
    assert v["tflops_per_gpu"] == pytest.approx(12e12 / 4.0 / 2 / 1e12)
    assert v["mfu"] == pytest.approx(v["tflops_per_gpu"] * 1e12 / 100e12)
    assert "steps 6-7" in average.line() and "warm-up" in average.line()
    assert "mfu" not in RunAverage(1, None).values()


def test_routine_deepspeed_line_dropped_others_kept():
    out = io.StringIO()
    with routine_lines_dropped(out.write):
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("something else DeepSpeed said")
    assert out.getvalue() == "something else DeepSpeed said\n"
    out = io.StringIO()
    with pytest.raises(RuntimeError), routine_lines_dropped(out.write):
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        raise RuntimeError("the build failed")
    assert "built successfully" in out.getvalue()  # nothing is routine in a failure


def test_accelerator_named_as_deepspeed_would_choose(monkeypatch):
    import torch

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    choose_accelerator()
    assert os.environ.get("DS_ACCELERATOR") == (None if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    choose_accelerator()
    assert os.environ["DS_ACCELERATOR"] == "cuda"  # the user's choice is kept


def test_shm_op_build_announced_only_when_not_cached(tmp_path, monkeypatch):
    from megatron_rembert.deepspeed_env import shm_op_build_note

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # torch's documented override
    note = shm_op_build_note()
    assert note is not None and "once per machine" in note and str(tmp_path) in note
    built = tmp_path / "py311_cpu" / "deepspeed_shm_comm"
    built.mkdir(parents=True)
    (built / "deepspeed_shm_comm.so").write_bytes(b"")
    assert shm_op_build_note() is None
