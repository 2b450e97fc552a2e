"""Nothing ends done that did not train (training/divergence.py): a step whose update was not
applied is never saved, `latest` never moves past the last good step, and a run whose last
steps were not applied ends with exit 2 and one `error:` line naming the last good step.

Real runs of train.py's main() (the real loop, data loader, engine and checkpoints) in which
the gradient of chosen steps is made infinite while their loss stays finite: the scaled loss
goes through `_InfGradient`, an identity forward whose backward multiplies by inf. What each
path does with such a gradient:
- bf16 and fp32 with ZeRO-1 (the fp32 main gradients, parallel/grad_buffer.py) skip the update
  (DeepSpeed counts a skipped step; weights, Adam state and LR schedule untouched), pp 1 and
  pp 2 alike;
- fp32 without ZeRO has no overflow check: the engine applies what the gradient held.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
from pathlib import Path

import pytest
import torch

from tests.training.conftest import SEQ

pytestmark = pytest.mark.multiprocess  # every test here starts processes


class _InfGradient(torch.autograd.Function):
    """Identity forward (the loss stays finite); backward sends an infinite gradient."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor) -> torch.Tensor:
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


def _train_injected(rank: int, world_size: int, argv: list[str], bad_steps: list[int],
                    signal_after: int | None) -> tuple[int, str, str]:
    """train.py's main() on one rank, the gradient of `bad_steps` made infinite, SIGTERM sent
    to this rank after step `signal_after`: exit code, stdout, stderr."""
    from megatron_rembert import train
    from megatron_rembert.training import engine

    real_step, real_scaled = engine.Trainer.train_step, engine._StepContext.scaled_loss
    calls = {"step": 0}

    def step(self, batches):
        calls["step"] += 1
        stats = real_step(self, batches)
        if calls["step"] == signal_after:
            os.kill(os.getpid(), signal.SIGTERM)
        return stats

    def scaled_loss(self, out, labels=None):
        loss = real_scaled(self, out, labels)  # the step's statistics are counted finite here
        return _InfGradient.apply(loss) if calls["step"] in bad_steps else loss

    engine.Trainer.train_step, engine._StepContext.scaled_loss = step, scaled_loss
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train.main(argv)
    return code, out.getvalue(), err.getvalue()


def _argv(tmp: Path, tiny_dataset, sets: dict) -> list[str]:
    data, tokenizer = tiny_dataset
    values = {"data.path": data, "data.tokenizer": tokenizer, "data.seq_length": SEQ,
              "data.num_workers": 0, "train.global_batch_size": 4,
              "train.micro_batch_size": 2, "train.eval_interval": 0, "train.log_interval": 1,
              "train.save_interval": 1, "train.keep_last": 10,
              "train.max_nonfinite_steps": 3, "train.save_dir": tmp / "ckpt",
              "train.log_dir": tmp / "logs", **sets}
    args = ["--config", "configs/tiny.yaml"]
    for key, value in values.items():
        args += ["--set", f"{key}={value}"]
    return args


def _saved(tmp: Path) -> tuple[str | None, list[int]]:
    latest = tmp / "ckpt" / "latest"
    return (latest.read_text().strip() if latest.exists() else None,
            sorted(int(p.name.split("_")[1]) for p in (tmp / "ckpt").glob("step_*")))


BF16_ZERO1 = {"train.precision": "bf16"}
FP32_ZERO1 = {"train.precision": "fp32"}

# (id, world size, settings, bad steps, SIGTERM after step, exit code, the line that must be
# printed (on every rank: the error line; on rank 0: the stop line), the step folders kept)
RUNS = [
    # One skipped step between good ones is tolerated (not saved); the run then ends on two
    # skipped steps: not done, the last good step named.
    ("bf16-zero1-pp1-ends-on-skipped-steps", 1, {**BF16_ZERO1, "train.steps": 6}, [2, 5, 6],
     None, 2, "error: step 6: the run ends on 2 step(s) whose update was not applied "
     "(non-finite gradient norm or loss; tolerated only between good steps); the last good "
     "step is 4; stopping.", [1, 3, 4]),
    # Skipped for good from step 3 on: train.max_nonfinite_steps=3 of them stop the run.
    ("bf16-zero1-pp2-skipped-from-step-3", 2,
     {**BF16_ZERO1, "parallel.pp": 2, "train.steps": 8}, [3, 4, 5, 6, 7, 8], None, 2,
     "error: step 5: 3 steps in a row whose update was not applied (non-finite gradient norm "
     "or loss; train.max_nonfinite_steps=3); the last good step is 2; stopping.", [1, 2]),
    # fp32 at pp 2: one skipped step tolerated, then the run ends on two.
    ("fp32-zero1-pp2-ends-on-skipped-steps", 2,
     {**FP32_ZERO1, "parallel.pp": 2, "train.steps": 5}, [2, 4, 5], None, 2,
     "error: step 5: the run ends on 2 step(s) whose update was not applied "
     "(non-finite gradient norm or loss; tolerated only between good steps); the last good "
     "step is 3; stopping.", [1, 3]),
    # A stop signal after a skipped step: that step is not saved, and said so; exit 0 for the
    # requeue, which resumes from the last good step.
    ("fp32-zero1-pp1-signal-after-a-skipped-step", 1, {**FP32_ZERO1, "train.steps": 6}, [3],
     3, 0, "signal received (SIGTERM): step 3 not saved (its update was not applied; the last "
     "good step is 2); last checkpoint: step 2, exiting for requeue", [1, 2]),
]


@pytest.mark.parametrize("case", RUNS, ids=[r[0] for r in RUNS])
def test_a_step_whose_update_was_not_applied_is_never_saved(case, tmp_path, tiny_dataset):
    from tests.distributed import run_distributed

    _, world, sets, bad, signal_after, code, line, kept = case
    results = run_distributed(_train_injected, world, _argv(tmp_path, tiny_dataset, sets),
                              bad, signal_after, timeout=400)
    for rank, (exit_code, out, err) in enumerate(results):
        what = f"rank {rank}:\n{out}\n{err}"
        assert exit_code == code, what
        assert "Traceback" not in err and "done at step" not in out, what
        errors = [x for x in err.splitlines() if "error:" in x]
        if code == 2:
            assert len(errors) == 1 and errors[0].startswith(line), what
            assert f"latest still names step_{kept[-1]:08d}, the last good checkpoint" in \
                errors[0], what
        elif rank == 0:
            assert not errors and line in out, what
    assert _saved(tmp_path) == (f"step_{kept[-1]:08d}", kept)
