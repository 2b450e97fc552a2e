"""forbid_host_syncs() catches each kind of host sync, in forward and in backward, and lets
ordinary ops (integer indexing included) through."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.host_sync import HostSyncError, forbid_host_syncs

x = torch.arange(6.0).reshape(2, 3)
mask = torch.tensor([True, False])


def _set_masked() -> None:
    y = x.clone()
    y[mask] = 0.0


def _if_tensor() -> None:
    if x.sum() > 0:  # bool(t)
        pass


SYNCS: dict[str, tuple[Callable, str]] = {
    "item": (lambda: x.sum().item(), "_local_scalar_dense"),
    "bool": (lambda: bool(x.sum() > 0), "_local_scalar_dense"),
    "if": (_if_tensor, "_local_scalar_dense"),
    "int": (lambda: int(x[0, 0]), "_local_scalar_dense"),
    "equal": (lambda: torch.equal(x, x), "equal"),
    "mask index": (lambda: x[mask], "index.Tensor"),
    "uint8 index": (lambda: x[mask.to(torch.uint8)], "index.Tensor"),
    "mask assignment": (_set_masked, "index_put"),
    "nonzero": (lambda: torch.nonzero(x), "nonzero"),
    "where(cond)": (lambda: torch.where(x > 1), "nonzero"),
    "masked_select": (lambda: torch.masked_select(x, x > 1), "masked_select"),
    "unique": (lambda: torch.unique(x), "unique"),
    "bincount": (lambda: torch.bincount(torch.tensor([0, 2])), "bincount"),
    "repeat_interleave": (lambda: torch.repeat_interleave(torch.tensor([1, 2])),
                          "repeat_interleave"),
    # meta stands in for CUDA here: the check runs before the copy would
    "to cpu": (lambda: torch.empty(3, device="meta").cpu(), "_to_copy"),
    "copy_ into cpu": (lambda: torch.empty(3).copy_(torch.empty(3, device="meta")), "copy_"),
}


@pytest.mark.parametrize("name", SYNCS)
def test_each_sync_is_caught_and_named(name: str) -> None:
    fn, op = SYNCS[name]
    with pytest.raises(HostSyncError, match=op):
        with forbid_host_syncs():
            fn()


def test_ordinary_ops_pass() -> None:
    w = torch.randn(3, 4, requires_grad=True)
    idx = torch.tensor([1, 0, 1])
    with forbid_host_syncs():
        y = torch.where(x > 1, x, 0.0) @ w  # 2 x 4
        y = y + x[:, idx].sum() + x[idx.clamp(max=1)][:, :2].sum()  # integer indexing
        z = torch.zeros(2, 4).index_put_((torch.tensor([1]),), torch.ones(4))  # integer index
        y = y.masked_fill(torch.tensor([[True], [False]]), 0.0) + z  # masked_fill is static
        y.gather(1, torch.tensor([[0], [3]])).sum().backward()
        torch.empty(2, device="meta").to("meta")  # device to itself: no host involved
    assert w.grad is not None and w.grad.shape == (3, 4)


class _ItemInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):  # noqa: ANN001, ANN205
        return t * 2

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        grad.sum().item()
        return grad * 2


def test_backward_is_watched_too() -> None:
    t = torch.ones(3, requires_grad=True)
    y = _ItemInBackward.apply(t).sum()  # forward outside the mode
    with pytest.raises(HostSyncError, match="_local_scalar_dense"):
        with forbid_host_syncs():
            y.backward()


def test_the_mode_ends_with_its_block() -> None:
    with forbid_host_syncs():
        pass
    assert x.sum().item() == 15.0
