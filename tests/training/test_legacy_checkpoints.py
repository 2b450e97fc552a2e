"""Checkpoints of version 0.2.0's DeepSpeed optimizers (fp16 ZeRO-1 with its loss scaler,
bf16 ZeRO-2, fp32 without ZeRO; tests/fixtures/checkpoints_v0_2_0) resume on today's gradient
path, at another layout, and steps 5 and 6 repeat what the run that wrote them logged: the same
losses within the precision's tolerance and learning rates. In fp16, step 5 grows the scale
when the checkpoint's schedule says (the restored iteration and last overflow: a scale restored
alone would not grow). Whether step 6 overflows is not compared: DeepSpeed's fp16 optimizer
held the embedding's and the output projection's gradients in fp16, ours sums them in fp32, so
different gradients can overflow; the scaler's decisions on a given sequence of overflows are
DeepSpeed's (tests/training/test_loss_scale.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed import run_distributed
from tests.training.helpers import SEQ, micro_batches

pytestmark = pytest.mark.multiprocess  # every test here starts processes

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints_v0_2_0"
GLOBAL_BATCH, MICRO = 8, 2
# name -> (precision, the ds_config today's run takes, (tp, pp, dp), relative loss tolerance)
CASES = {"fp16-zero1": ("fp16", "ds.json", (1, 2, 1), 2e-4),
         "bf16-zero2": ("bf16", None, (2, 1, 1), 2e-3),
         "fp32-zero0": ("fp32", None, (1, 1, 2), 1e-5)}


def _resume(rank, world_size, name: str) -> list[dict]:
    import deepspeed
    import torch

    from megatron_rembert.checkpoint.step_folder import StepFolder
    from megatron_rembert.parallel import state
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training import checkpoint as ckpt
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.plan import RunPlan

    precision, ds, (tp, pp, _), _ = CASES[name]
    deepspeed.init_distributed(dist_backend="gloo")
    config = build_config({"model": {"preset": "tiny", "vocab_size": 256}}, [
        f"parallel.tp={tp}", f"parallel.pp={pp}", f"train.precision={precision}",
        f"train.global_batch_size={GLOBAL_BATCH}", f"train.micro_batch_size={MICRO}",
        "train.steps=6", "optim.warmup_steps=2", "optim.lr=3e-3", "optim.clip_grad=0.5",
        f"data.seq_length={SEQ}",
        f"parallel.ds_config={FIXTURES / name / ds if ds else ''}"])
    plan = RunPlan.build(config, world_size, rank)
    s = state.initialize_model_parallel(plan.layout)
    trainer = Trainer(config, plan, torch.device("cpu"))
    folder = StepFolder.open(FIXTURES / name / "checkpoints" / "step_00000004")
    assert ckpt.load_checkpoint(trainer.engine, folder, how="full").step == 4
    rows = []
    for step in (4, 5):
        stats = trainer.train_step(micro_batches(step, GLOBAL_BATCH, MICRO, s.dp_rank,
                                                 plan.layout.dp, config.model.vocab_size))
        rows.append({"step": step + 1, "loss": stats.loss, "loss_scale": stats.loss_scale,
                     "skipped": stats.skipped, "lr": stats.lr})
    trainer.wait_for_weights()
    return rows


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_checkpoint_of_deepspeeds_optimizers_resumes_on_ours(name):
    precision, _, (tp, pp, dp), rel = CASES[name]
    expected = json.loads((FIXTURES / name / "uninterrupted.json").read_text())[4:]
    for rows in run_distributed(_resume, tp * pp * dp, name, timeout=300):
        for row, ref in zip(rows, expected, strict=True):
            assert row["step"] == ref["step"]
            assert row["loss"] == pytest.approx(ref["loss"], rel=rel), row
            assert row["lr"] == pytest.approx(ref["lr"]), row
            if precision != "fp16" or row["step"] == 5:
                assert row["skipped"] == ref["skipped"], row
        if precision == "fp16":  # saved at 2^17 after step 4: step 5 doubles it
            assert rows[0]["loss_scale"] == expected[0]["loss_scale"] == 2.0 ** 18
            assert rows[1]["loss_scale"] == 2.0 ** 18  # overflow (hysteresis) or not: kept
