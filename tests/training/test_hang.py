"""A hang is reported within parallel.timeout_minutes, with each rank's position."""

from __future__ import annotations

import time

import pytest

from tests.distributed import run_distributed
from tests.training.production import as_sets, data_overrides

TIMEOUT_MIN = 0.15  # 9 s


def _train_with_straggler(rank, world_size, sets):
    """pp = 2; stage 1 stalls for twice the timeout before its second step."""
    from megatron_rembert.run_config import load_config
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
