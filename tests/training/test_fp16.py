"""fp16 with dynamic loss scaling on our gradient path (training/loss_scale.py, the distributed
optimizer): overflow steps skipped, the scale's schedule through a resume. (That fp16 trains as
fp32 does at gas 4, tp 2 x dp 2 and pp 2 is tests/training/test_production_path.py's fp16
cases; that the scaler decides as DeepSpeed's does is tests/training/test_loss_scale.py.)

torch computes fp16 on this CPU (slowly): its own kernels, DeepSpeed's fp16 is not involved.
"""

import json

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.test_loop import losses, overrides, rows

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def _train_fp16(rank, world_size, sets):
    """train() from configs/tiny.yaml; records, per step, whether the weights changed."""
    from megatron_rembert.run_config.load import load_config
    from megatron_rembert.training import engine, loop

    real_step = engine.Trainer.train_step
    changed = []

    def step(self, batches):
        self.wait_for_weights()
        before = [p.detach().clone() for p in self.engine.module.parameters()]
        stats = real_step(self, batches)
        self.wait_for_weights()
        changed.append(any(not torch.equal(b, p) for b, p in
                           zip(before, self.engine.module.parameters(), strict=True)))
        return stats

    engine.Trainer.train_step = step
    loop.train(load_config("configs/tiny.yaml", sets))
    return changed


def test_overflow_skips_the_step_and_halves_the_scale(tmp_path, tiny_dataset):
    """A loss scale of 2^24 overflows the fp16 gradients: such a step leaves the weights and
    the learning-rate schedule alone and halves the scale, until the scale fits. Such steps
    count towards train.max_nonfinite_steps like any step whose update was not applied (set
    here above this search's length) and are never saved."""
    ds_config = tmp_path / "fp16_high_scale.json"
    ds_config.write_text(json.dumps({"fp16": {"loss_scale": 0, "initial_scale_power": 24,
                                              "loss_scale_window": 1000, "hysteresis": 1}}))
    sets = overrides(tmp_path, *tiny_dataset, **{
        "train.precision": "fp16", "parallel.ds_config": ds_config, "train.steps": 12,
        "train.max_nonfinite_steps": 12, "train.eval_interval": 0,
        "train.save_interval": 1, "train.keep_last": 12})
    changed = run_distributed(_train_fp16, 2, sets, timeout=300)[0]
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text()
            .splitlines()]
    rows = [r for r in rows if r["split"] == "train"]  # not the run_average row
    skipped = [r["skipped"] for r in rows]
    first_real = skipped.index(False)
    assert first_real >= 2 and not any(skipped[first_real:]), skipped
    assert changed == [not s for s in skipped]
    scales = [r["loss_scale"] for r in rows]
    assert scales[0] == 2.0**23  # reported after the step: already halved
    for before, after, skip in zip(scales, scales[1:], skipped[1:], strict=False):
        assert after == (before / 2 if skip else before)
    lrs = [r["lr"] for r in rows]
    assert len(set(lrs[:first_real + 1])) == 1  # the schedule waits for a real step
    assert lrs[first_real + 1] > lrs[first_real]  # warm-up goes on afterwards
    train = losses(tmp_path / "logs")
    assert all(torch.isfinite(torch.tensor(list(train.values()))))
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000012"
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == [
        f"step_{step:08d}" for step in range(first_real + 1, 13)]


def _train_fp16_stopped(rank, world_size, sets, signal_at=None):
    """test_loop's train() (stopped by a signal after step `signal_at`)."""
    from tests.training.test_loop import _train

    return _train(rank, world_size, sets, signal_at)


def test_resume_continues_the_loss_scale_schedule(tmp_path, tiny_dataset):
    """The loss scaler's whole state (scale, iteration, last overflow, hysteresis) is saved in
    the checkpoint and restored: with a growth window of 3 steps after the initial overflows,
    a run stopped after step 4 and resumed logs the scales and losses of the run that never
    stopped (restored with the scale alone, its next growth would come 3 steps after the
    resume instead)."""
    ds_config = tmp_path / "fp16_window.json"
    ds_config.write_text(json.dumps({"fp16": {"loss_scale": 0, "initial_scale_power": 20,
                                              "loss_scale_window": 3, "hysteresis": 1}}))
    extra = {"train.precision": "fp16", "parallel.ds_config": ds_config, "train.steps": 10,
             "train.max_nonfinite_steps": 10, "train.eval_interval": 0}
    straight = tmp_path / "straight"
    run_distributed(_train_fp16_stopped, 2, overrides(straight, *tiny_dataset, **extra),
                    timeout=300)
    expected = rows(straight / "logs")
    sets = overrides(tmp_path, *tiny_dataset, **extra)
    assert run_distributed(_train_fp16_stopped, 2, sets, 4, timeout=300) == [4, 4]
    run_distributed(_train_fp16_stopped, 2, sets, timeout=300)
    resumed = rows(tmp_path / "logs")
    assert sorted(resumed) == sorted(expected) == list(range(1, 11))
    scales = [expected[s]["loss_scale"] for s in sorted(expected)]
    assert len(set(scales[4:])) > 1  # the scale changes after the resume point
    for step, row in expected.items():
        assert resumed[step]["loss_scale"] == row["loss_scale"], step
        assert resumed[step]["loss"] == pytest.approx(row["loss"], rel=1e-6), step
