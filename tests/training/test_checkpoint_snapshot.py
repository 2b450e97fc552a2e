"""training/checkpoint.py's `snapshot`: what a background save writes is copied off the
training buffers at the save. Against torch.save of the live state: the same bytes, shared
storages still shared, and later writes to the live tensors change nothing in the copy."""

from __future__ import annotations

import io
from collections import OrderedDict

import torch

from megatron_rembert.training.checkpoint import snapshot


def _state() -> dict:
    flat = torch.arange(24, dtype=torch.float32)
    weight = torch.nn.Parameter(torch.randn(3, 4))
    return {"module": OrderedDict(w=weight.detach(), first=flat[:8].view(2, 4),
                                  rest=flat[8:]),  # two views of one flat buffer
            "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": flat[2:10]}},
                          "param_groups": [{"lr": 1e-3, "params": [0]}]},
            "master": [weight, flat.t() if flat.dim() == 2 else flat[::2]],  # strided view
            "shapes": (torch.Size([3, 4]), "name"), "step": 7, "extra": {"nested": [1, 2]},
            "linear": torch.nn.Linear(2, 3).state_dict()}  # an OrderedDict with `_metadata`


def _bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_snapshot_saves_the_same_bytes():
    state = _state()
    assert _bytes(snapshot(state)) == _bytes(state)


def test_snapshot_keeps_shared_storages_shared_and_types():
    copy = snapshot(_state())
    first, rest = copy["module"]["first"], copy["module"]["rest"]
    assert first.untyped_storage().data_ptr() == rest.untyped_storage().data_ptr()
    assert copy["optimizer"]["state"][0]["exp_avg"].untyped_storage().data_ptr() == \
        first.untyped_storage().data_ptr()
    assert isinstance(copy["module"], OrderedDict)
    assert copy["linear"]._metadata == {"": {"version": 1}}
    assert isinstance(copy["master"][0], torch.nn.Parameter)
    assert copy["master"][0].requires_grad
    assert copy["master"][1].stride() == (2,)
    shared = [1, 2]
    twice = snapshot({"a": shared, "b": shared})
    assert twice["a"] is twice["b"] and twice["a"] is not shared


def test_later_training_writes_do_not_reach_the_snapshot():
    state = _state()
    before = _bytes(state)
    copy = snapshot(state)
    with torch.no_grad():
        state["module"]["rest"].add_(1.0)
        state["master"][0].mul_(2.0)
        state["optimizer"]["state"][0]["step"] += 1
    state["extra"]["nested"].append(3)
    state["optimizer"]["param_groups"][0]["lr"] = 0.5
    assert _bytes(copy) == before
    assert _bytes(state) != before
