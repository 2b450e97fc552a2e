"""When a run has diverged, and which checkpoints are good.

A step is good when its loss is finite, its update was applied with a finite gradient norm
(or skipped by fp16's loss scaler: weights untouched) and its loss is within
`train.divergence_factor` of the mean of the last `train.divergence_window` losses. A
checkpoint is good when its step was and, at save time, every weight is finite and at most
`train.max_weight_abs` in magnitude. Anything else stops the run with a `DivergenceError` (one
`error:` line, exit 2) naming the step `latest` still points at: `latest` never moves to a step
that was not good.

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
    """The per-step rule, fed the step's already reduced statistics (no device work)."""

    def __init__(self, factor: float, window: int, max_nonfinite_skipped: int):
        self.factor = factor  # 0: no loss-jump check
        self.window = window
        self.max_nonfinite_skipped = max_nonfinite_skipped
        self.recent: deque[float] = deque(maxlen=window)
        self.skipped_in_a_row = 0

    def problem(self, loss: float, grad_norm_finite: bool, skipped: bool) -> str | None:
        """Why this step diverged, or None; then the loss counts into the recent mean."""
        if skipped:  # fp16 overflow: the loss scaler halves its scale and tries again
            self.skipped_in_a_row = 0 if math.isfinite(loss) else self.skipped_in_a_row + 1
            if self.skipped_in_a_row >= self.max_nonfinite_skipped:
                return (f"{self.skipped_in_a_row} consecutive skipped steps with a non-finite "
                        f"loss (train.max_nonfinite_steps={self.max_nonfinite_skipped})")
        else:
            self.skipped_in_a_row = 0
            if not math.isfinite(loss):
                return f"the loss is {loss}"
            if not grad_norm_finite:
                return "the gradient norm is not finite"
        if math.isfinite(loss):
            if self.factor and len(self.recent) == self.window:
                mean = sum(self.recent) / len(self.recent)
                if loss > self.factor * mean:
                    return (f"the loss {loss:.4g} is more than train.divergence_factor="
                            f"{self.factor:g} times the mean of the last {self.window} steps "
                            f"({mean:.4g})")
            self.recent.append(loss)
        return None


def step_is_good(loss: float, grad_norm_finite: bool, skipped: bool) -> bool:
    """Whether a step's statistics allow saving it (its weights are checked at the save)."""
    return math.isfinite(loss) and (skipped or grad_norm_finite)


@torch.no_grad()
def weights_max_abs(parameters: Iterable[torch.Tensor]) -> float:
    """The largest |weight| over every rank's parameters; inf when any is inf or NaN. One
    max per tensor on the device, one collective, one read-back."""
    tensors = [p.detach() for p in parameters if p.numel()]
    largest = torch.zeros(1, dtype=torch.float64, device=comm.device())
    if tensors:
        norms = torch._foreach_norm(tensors, math.inf)  # per tensor, in its own dtype
        top = torch.stack([n.to(largest.device, torch.float64) for n in norms]).max()
        # NaN is unordered, so a MAX reduction could drop it: counted as inf.
        largest[0] = torch.where(top.isfinite(), top, math.inf)
    (value,) = comm.to_host(comm.all_reduce(largest, op=dist.ReduceOp.MAX))
    return value


def check_weights(parameters: Iterable[torch.Tensor], step: int, limit: float,
                  save_dir: str | Path) -> None:
    """Refuses (DivergenceError, on every rank) to save step `step` unless its weights are
    finite and within +-`limit` (train.max_weight_abs)."""
    largest = weights_max_abs(parameters)
    if math.isfinite(largest) and largest <= limit:  # inf: some weight is inf or NaN
        return
    what = ("some weights are inf or NaN" if math.isinf(largest) else
            f"the largest |weight| is {largest:.3g}, beyond train.max_weight_abs={limit:g}")
    raise DivergenceError(stop_message(step, f"{what}; not saved", save_dir))
