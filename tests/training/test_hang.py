"""A hang is reported within parallel.timeout_minutes, with each rank's position; what counts
as a failed collective is told by the error's type and origin, never by its message."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_rembert.checkpoint import CheckpointError
from megatron_rembert.config import ConfigError
from megatron_rembert.data.common import DataError
from megatron_rembert.training.hang import is_collective_failure
from tests.distributed import free_port, run_distributed
from tests.training.production import as_sets, data_overrides

TIMEOUT_MIN = 0.15  # 9 s
ROOT = Path(__file__).resolve().parents[2]


def _train_with_straggler(rank, world_size, sets):
    """pp = 2; stage 1 stalls for twice the timeout before its second step."""
    from megatron_rembert.run_config.load import load_config
    from megatron_rembert.training import engine, loop

    real_step = engine.Trainer.train_step
    calls = {"n": 0}

    def step(self, batches):
        calls["n"] += 1
        if rank == 1 and calls["n"] == 2:
            time.sleep(2 * 60 * TIMEOUT_MIN)
        return real_step(self, batches)

    engine.Trainer.train_step = step
    loop.train(load_config("configs/tiny.yaml", sets))


@pytest.mark.multiprocess
def test_missed_collective_fails_with_each_ranks_position(tiny_dataset, tmp_path, capfd):
    sets = {**data_overrides(*tiny_dataset, tmp_path, 4), "parallel.pp": 2,
            "parallel.timeout_minutes": TIMEOUT_MIN}
    start = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_distributed(_train_with_straggler, 2, as_sets(sets), timeout=300,
                        init_process_group=False)
    assert time.monotonic() - start < 240  # not gloo's 10 minutes
    message = str(failure.value)
    # Stage 0 waited for stage 1's gradient in step 2's schedule, and says so.
    assert "rank 0 was at step 2, train step, pipeline instruction" in message
    assert "TrainingError" in message and "parallel.timeout_minutes=0.15" in message
    # Before the timeout, the watchdog had printed the same position (all NCCL leaves).
    assert "[hang watchdog] rank 0 was at step 2, train step, pipeline instruction" \
        in capfd.readouterr().err


@pytest.mark.multiprocess
def test_user_error_naming_gloo_nccl_timeout_is_a_clean_exit_2(tiny_dataset, tmp_path):
    """A checkpoint error whose message happens to contain "gloo", "nccl" and "timeout" (they
    are in the save folder's name) is bad input: one `error:` line and exit 2, not the
    collective-failure path's traceback and exit 1."""
    save_dir = tmp_path / "gloo-nccl-timeout"
    save_dir.mkdir()
    (save_dir / "latest").write_text("step_00000007")  # names a folder that does not exist
    sets = {**data_overrides(*tiny_dataset, tmp_path, 2), "train.save_dir": save_dir}
    args = [a for s in as_sets(sets) for a in ("--set", s)]
    env = {**os.environ, "MASTER_PORT": str(free_port())}
    run = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.yaml", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2, run.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "gloo-nccl-timeout/latest names" in errors[0], errors[0]


def _raised(err: BaseException) -> BaseException:
    """`err` as an except clause holds it: with the traceback of where it was raised."""
    try:
        raise err
    except BaseException as caught:  # noqa: BLE001 - any error, as the loop catches it
        return caught


def test_the_message_never_decides():
    words = "Timed out waiting 3000ms (gloo); NCCL timeout; Connection closed by peer"
    for err in (CheckpointError(words), DataError(words), ConfigError(words),
                RuntimeError(words)):  # raised by our code, not by torch.distributed
        assert not is_collective_failure(_raised(err)), type(err)
    for err in (dist.DistBackendError("NCCL error"), dist.DistNetworkError("reset"),
                dist.DistStoreError("store")):
        assert is_collective_failure(_raised(err)), type(err)


def _collective_after_a_silent_peer(rank, world_size, how):
    """Rank 1 sleeps past gloo's timeout; rank 0's collective fails. Returns what rank 0
    caught: its type, whether it is one of torch's DistErrors, and the verdict."""
    from datetime import timedelta

    from megatron_rembert.parallel import comm

    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=3))
    if rank == 1:
        time.sleep(10)
        return None
    try:
        if how == "all_reduce":
            comm.all_reduce(torch.ones(4))
        elif how == "recv":  # the blocking receive DeepSpeed's pipeline makes (runtime/pipe/p2p.py)
            dist.recv(torch.zeros(4), src=1)
        else:  # a gradient bucket's asynchronous reduce-scatter, waited for at the step
            flat = torch.ones(8)
            handle = comm.reduce_scatter(flat[:4], flat, async_op=True)
            if how == "reduce_scatter":
                comm.wait(handle)
            else:  # the raw wait, the control
                handle.wait()
    except Exception as err:  # noqa: BLE001 - whatever gloo raises
        return type(err).__name__, isinstance(err, dist.DistError), is_collective_failure(err)
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["all_reduce", "recv"])
def test_a_real_gloo_timeout_is_a_collective_failure(how):
    first, _ = run_distributed(_collective_after_a_silent_peer, 2, how, timeout=120,
                               init_process_group=False)
    # torch 2.13's gloo raises a plain RuntimeError, not a DistError: recognised by its origin.
    assert first == ("RuntimeError", False, True), first


@pytest.mark.multiprocess
def test_a_failed_asynchronous_collective_is_a_collective_failure_through_comm_wait():
    """The wait of an asynchronous handle raises gloo's RuntimeError outside torch.distributed
    (the control: not recognised); comm.wait, which the gradient buckets and the weights'
    all-gather use, raises torch's DistBackendError instead."""
    ours, _ = run_distributed(_collective_after_a_silent_peer, 2, "reduce_scatter",
                              timeout=120, init_process_group=False)
    raw, _ = run_distributed(_collective_after_a_silent_peer, 2, "raw_wait", timeout=120,
                             init_process_group=False)
    assert ours == ("DistBackendError", True, True), ours
    assert raw == ("RuntimeError", False, False), raw
