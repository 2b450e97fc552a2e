"""training/loss_scale.py decides as DeepSpeed's DynamicLossScaler (the reference: what fp16
trained with before DeepSpeed's optimizers left the path) on the same sequences of overflows,
with and without hysteresis, consecutive hysteresis and a floor; and reads a ds_config's fp16
section as DeepSpeed does."""

from __future__ import annotations

import random

import pytest

from megatron_rembert.config import ConfigError
from megatron_rembert.training.loss_scale import FP16_KEYS, LossScaler


def _deepspeed_scaler(monkeypatch, **fp16):
    """DeepSpeed's own scaler of a ds_config's fp16 section, as its fp16 optimizers build it."""
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)  # it logs from rank 0
    v = {**FP16_KEYS, **fp16}
    return DynamicLossScaler(init_scale=2.0 ** v["initial_scale_power"],
                             scale_window=v["loss_scale_window"],
                             min_scale=v["min_loss_scale"], delayed_shift=v["hysteresis"],
                             consecutive_hysteresis=v["consecutive_hysteresis"],
                             raise_error_at_min_scale=False)


def _sequences():
    rng = random.Random(0)
    yield [True] * 3 + [False] * 12 + [True, False, True, True] + [False] * 9
    for _ in range(20):  # bursts and quiet stretches
        yield [rng.random() < p for p in [0.4] * 10 + [0.05] * 30 + [0.5] * 10]


@pytest.mark.parametrize("fp16", [
    {"initial_scale_power": 16, "loss_scale_window": 4, "hysteresis": 2},
    {"initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 1},
    {"initial_scale_power": 12, "loss_scale_window": 2, "hysteresis": 3,
     "consecutive_hysteresis": True},
    {"initial_scale_power": 4, "loss_scale_window": 5, "hysteresis": 1, "min_loss_scale": 4},
])
def test_same_scale_skip_and_growth_decisions_as_deepspeed(fp16, monkeypatch):
    for overflows in _sequences():
        ours = LossScaler.from_ds_config(fp16, "test")
        theirs = _deepspeed_scaler(monkeypatch, **fp16)
        for i, overflow in enumerate(overflows):
            assert ours.cur_scale == theirs.cur_scale, (i, overflows)
            ours.update(overflow)
            theirs.update_scale(overflow)
            assert ours.state_dict() == {k: float(getattr(theirs, k))
                                         for k in ("cur_scale", "cur_iter",
                                                   "last_overflow_iter", "cur_hysteresis")}


def test_state_round_trips_and_a_static_scale_never_moves():
    ours = LossScaler.from_ds_config({"loss_scale_window": 2}, "test")
    for overflow in (True, True, False, False, False):
        ours.update(overflow)
    copy = LossScaler.from_ds_config({"loss_scale_window": 2}, "test")
    copy.load_state_dict(ours.state_dict())
    for overflow in (False, True, False, False):
        ours.update(overflow)
        copy.update(overflow)
        assert copy.state_dict() == ours.state_dict()
    static = LossScaler.from_ds_config({"loss_scale": 128}, "test")
    for overflow in (True, True, False):
        static.update(overflow)
    assert static.cur_scale == 128 and not static.dynamic


@pytest.mark.parametrize("fp16, message", [
    ({"initial_scale_power": 0}, "fp16.initial_scale_power=0: an integer >= 1"),
    ({"loss_scale_window": 2.5}, "fp16.loss_scale_window=2.5: an integer >= 1"),
    ({"min_loss_scale": -1}, "fp16.min_loss_scale=-1: a number >= 0"),
    ({"consecutive_hysteresis": 1}, "fp16.consecutive_hysteresis=1: true or false"),
    ({"auto_cast": True}, "sets fp16.auto_cast, which is not a loss-scale setting"),
])
def test_bad_fp16_settings_name_the_key(fp16, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        LossScaler.from_ds_config(fp16, "ds.json")
