"""When a run has diverged, and which steps and checkpoints are good.

The rule, in one place: a run never reports success, exits 0 or moves `latest` onto a step
after which no good update was applied.

- A step is good when its update was applied with a finite loss and a finite gradient norm
  and its loss is within `train.divergence_factor` of the mean of the last
  `train.divergence_window` losses. Only a good step is saved; `latest` never moves past the
  last good step.
- An applied update with a non-finite loss or gradient norm (fp32 without ZeRO: the engine
  applies whatever the gradient held) or a loss beyond the factor stops the run at once.
- A step whose update was not applied (skipped for a non-finite gradient norm, in any
  precision: fp16's loss scaler, the fp32 main gradients of bf16 and fp32 ZeRO-1,
  DeepSpeed's ZeRO optimizers; weights, Adam state and LR schedule untouched) is tolerated
  only between good steps: `train.max_nonfinite_steps` such steps in a row stop the run, and
  so does reaching `train.steps` on one (the end of a run must be a good step; fp16 included,
  whose loss-scale search skips steps now and then).
- A stop signal after such steps saves nothing new and says which step was the last good one
  (training/loop.py): the requeued run resumes from `latest` and redoes the steps after it.

A checkpoint is good when its step was and, at save time, every weight is finite and at most
`train.max_weight_abs` in magnitude. A stop is a `DivergenceError` (one `error:` line, exit 2)
naming the last good step and the step `latest` still names.

Every rank decides alike without a collective of its own: the loss and the gradient norm are
already reduced over all ranks when a step ends, and the weights' largest magnitude is reduced
once per save (the save's one extra collective).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rembert.checkpoint.step_folder import LATEST
from megatron_rembert.errors import UserError
from megatron_rembert.parallel import comm

HINT = ("lower optim.lr in a fresh train.save_dir (a resume keeps the saved rate), raise "
        "optim.warmup_steps, check the data, or use bf16 over fp16")


class DivergenceError(UserError):
    """The run diverged (non-finite or exploding loss, gradient norm or weights)."""


def stop_message(step: int, what: str, save_dir: str | Path) -> str:
    """The one line a diverged run stops with, naming the checkpoint `latest` keeps."""
    return f"step {step}: {what}; stopping. {kept(save_dir)}. To go on: {HINT}"


def kept(save_dir: str | Path) -> str:
    """What `latest` in `save_dir` names now, said for the stop message."""
    latest = Path(save_dir) / LATEST
    try:
        name = latest.read_text().strip()
    except OSError:
        name = ""
    if not name:
        return f"no checkpoint is kept in {save_dir} (none was saved before)"
    return f"{latest} still names {name}, the last good checkpoint"


class DivergenceCheck:
    """The per-step rule, fed the step's already reduced statistics (no device work).
    `last_good`: the last good step (`start_step`, a resumed checkpoint's step, to begin
    with; 0: none yet); `not_applied`: the steps after it whose update was not applied."""

    def __init__(self, factor: float, window: int, max_not_applied: int, start_step: int = 0):
        self.factor = factor  # 0: no loss-jump check
        self.window = window
        self.max_not_applied = max_not_applied
        self.recent: deque[float] = deque(maxlen=window)
        self.last_good = start_step
        self.not_applied = 0

    def problem(self, step: int, loss: float, grad_norm_finite: bool, skipped: bool,
                last_step: bool = False) -> str | None:
        """Why the run must stop after step `step` (`last_step`: the run's last), or None;
        then a finite loss counts into the recent mean."""
        if not skipped and not (math.isfinite(loss) and grad_norm_finite):
            what = (f"the loss is {loss}" if not math.isfinite(loss) else
                    "the gradient norm is not finite")
            return self._stop(f"{what} and the update was applied")
        if skipped:  # weights, Adam state and LR untouched (fp16: the loss scale halves)
            self.not_applied += 1
            if self.not_applied >= self.max_not_applied:
                return self._stop(f"{self.not_applied} steps in a row whose update was not "
                                  "applied (non-finite gradient norm or loss; "
                                  f"train.max_nonfinite_steps={self.max_not_applied})")
            if last_step:
                return self._stop(f"the run ends on {self.not_applied} step(s) whose update "
                                  "was not applied (non-finite gradient norm or loss; "
                                  "tolerated only between good steps)")
        if math.isfinite(loss):
            if self.factor and len(self.recent) == self.window:
                mean = sum(self.recent) / len(self.recent)
                if loss > self.factor * mean:
                    return self._stop(
                        f"the loss {loss:.4g} is more than train.divergence_factor="
                        f"{self.factor:g} times the mean of the last {self.window} steps "
                        f"({mean:.4g})")
            self.recent.append(loss)
        if not skipped:
            self.last_good, self.not_applied = step, 0
        return None

    def last_good_said(self) -> str:
        return (f"the last good step is {self.last_good}" if self.last_good else
                "no step was good")

    def unsaved(self, step: int) -> str:
        """What a stop signal after step `step`, not good, says about it."""
        return f"step {step} not saved (its update was not applied; {self.last_good_said()})"

    def _stop(self, what: str) -> str:
        return f"{what}; {self.last_good_said()}"


@torch.no_grad()
def weights_max_abs(parameters: Iterable[torch.Tensor], host_group=None) -> float:
    """The largest |weight| over every rank's parameters; inf when any is inf or NaN. One
    max per tensor on the device, one collective, one read-back. `host_group` (from
    comm.new_host_group): the tensors are host copies and the ranks agree on CPU over that
    group (the background checkpoint writer)."""
    tensors = [p.detach() for p in parameters if p.numel()]
    device = torch.device("cpu") if host_group is not None else comm.device()
    largest = torch.zeros(1, dtype=torch.float64, device=device)
    if tensors:
        norms = torch._foreach_norm(tensors, math.inf)  # per tensor, in its own dtype
        top = torch.stack([n.to(largest.device, torch.float64) for n in norms]).max()
        # NaN is unordered, so a MAX reduction could drop it: counted as inf.
        largest[0] = torch.where(top.isfinite(), top, math.inf)
    if host_group is not None:
        return comm.host_all_reduce(float(largest[0]), host_group, dist.ReduceOp.MAX)
    (value,) = comm.to_host(comm.all_reduce(largest, op=dist.ReduceOp.MAX))
    return value


def check_weights(parameters: Iterable[torch.Tensor], step: int, limit: float,
                  save_dir: str | Path, host_group=None) -> None:
    """Refuses (DivergenceError, on every rank) to save step `step` unless its weights are
    finite and within +-`limit` (train.max_weight_abs). `host_group`: as weights_max_abs."""
    largest = weights_max_abs(parameters, host_group)
    if math.isfinite(largest) and largest <= limit:  # inf: some weight is inf or NaN
        return
    what = ("some weights are inf or NaN" if math.isinf(largest) else
            f"the largest |weight| is {largest:.3g}, beyond train.max_weight_abs={limit:g}")
    raise DivergenceError(stop_message(step, f"{what}; not saved", save_dir))
