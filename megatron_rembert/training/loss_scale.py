"""fp16's loss scale: the loss is multiplied by it before backward, the gradients divided by it
in the optimizer step (training/distributed_optimizer.py), and a step whose gradients overflow
is skipped.

The rule is DeepSpeed's DynamicLossScaler's (runtime/fp16/loss_scaler.py), so a ds_config's
`fp16` section means here what it meant under DeepSpeed's fp16 optimizers, and a checkpoint of
those optimizers resumes with its scale where it was (the state's four fields keep DeepSpeed's
names: checkpoints of version 0.2.0 hold them):
- an overflow with hysteresis left (`cur_hysteresis` > 1, `hysteresis` > 1) only uses one up;
  otherwise it halves the scale, down to `min_loss_scale`. An overflow at the minimum is
  skipped like any other (DeepSpeed raises there): train.max_nonfinite_steps steps in a row
  whose update was not applied stop the run (training/divergence.py);
- a step without overflow doubles the scale once `loss_scale_window` steps have passed since
  the last overflow without one (the first such step after an overflow does not count), and
  refills the hysteresis then, or at every such step with `consecutive_hysteresis`;
- `loss_scale` > 0 in the JSON: a static scale, never changed (an overflow still skips).
tests/training/test_loss_scale.py makes the same decisions as DeepSpeed's class on the same
sequences of overflows.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rembert.config import ConfigError

# The ds_config's `fp16` keys this scaler takes, and DeepSpeed's defaults for them.
FP16_KEYS = {"loss_scale": 0.0, "initial_scale_power": 16, "loss_scale_window": 1000,
             "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1.0}
STATE_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


@dataclass
class LossScaler:
    """The loss scale of fp16 (see the module docstring); `dynamic=False`: a static scale."""

    cur_scale: float
    dynamic: bool = True
    scale_window: int = 1000
    min_scale: float = 1.0
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    cur_iter: int = 0
    last_overflow_iter: int = -1
    cur_hysteresis: int = 2

    @classmethod
    def from_ds_config(cls, fp16: dict, source: str) -> LossScaler:
        """From a ds_config's `fp16` section (`source` names the file in errors)."""
        unknown = sorted(set(fp16) - set(FP16_KEYS) - {"enabled"})
        if unknown:
            raise ConfigError(f"{source} sets fp16.{unknown[0]}, which is not a loss-scale "
                              f"setting this trainer applies; the fp16 keys it takes: "
                              f"{', '.join(sorted(FP16_KEYS))}")
        v = {**FP16_KEYS, **fp16}
        for key in ("loss_scale", "min_loss_scale"):
            if not isinstance(v[key], int | float) or isinstance(v[key], bool) or v[key] < 0:
                raise ConfigError(f"{source} sets fp16.{key}={v[key]!r}: a number >= 0")
        for key in ("initial_scale_power", "loss_scale_window", "hysteresis"):
            if not isinstance(v[key], int) or isinstance(v[key], bool) or v[key] < 1:
                raise ConfigError(f"{source} sets fp16.{key}={v[key]!r}: an integer >= 1")
        if not isinstance(v["consecutive_hysteresis"], bool):
            raise ConfigError(f"{source} sets fp16.consecutive_hysteresis="
                              f"{v['consecutive_hysteresis']!r}: true or false")
        if v["loss_scale"] > 0:
            return cls(float(v["loss_scale"]), dynamic=False)
        return cls(float(2 ** v["initial_scale_power"]), scale_window=v["loss_scale_window"],
                   min_scale=float(v["min_loss_scale"]), hysteresis=v["hysteresis"],
                   consecutive_hysteresis=v["consecutive_hysteresis"],
                   cur_hysteresis=v["hysteresis"])

    def update(self, overflow: bool) -> None:
        """After a step: `overflow` says whether its gradients were not finite."""
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.cur_scale *= 2
        self.cur_iter += 1

    def state_dict(self) -> dict:
        """Where the scale is in its schedule (DeepSpeed's field names; numbers only)."""
        return {k: float(getattr(self, k)) for k in STATE_FIELDS}

    def load_state_dict(self, saved: dict) -> None:
        """A `state_dict()`, or the part of one an older checkpoint holds (a static scaler's
        `cur_scale` only)."""
        for key in STATE_FIELDS:
            if key in saved:
                value = saved[key]
                setattr(self, key, float(value) if key == "cur_scale" else int(value))
