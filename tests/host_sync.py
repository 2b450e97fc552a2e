"""`forbid_host_syncs()`: fail on any op that makes the host wait for the device.

    from tests.host_sync import forbid_host_syncs
    with forbid_host_syncs():
        loss = model(batch); loss.backward()

On a GPU the host queues kernels ahead of the device; an op whose output shape or Python value
depends on the data (`nonzero`, `.item()`, `bool(t)`, `t[mask]`) or a copy back to the CPU
makes it wait until the device has caught up, every micro-batch. On CPU nothing waits, so such
an op goes unnoticed; this mode sees the aten ops as they are dispatched (a TorchDispatchMode,
on CPU as on CUDA, backward included: the autograd engine carries the mode into its threads)
and raises `HostSyncError` naming the first one of:

- `aten._local_scalar_dense` / `aten.item` (`.item()`, `bool(t)`, `int(t)`, `if t:`), and
  `aten.equal` (a Python bool computed from the data);
- an op tagged `torch.Tag.dynamic_output_shape` (nonzero, masked_select, unique, bincount,
  repeat_interleave with a tensor of repeats, one_hot, ...) or `data_dependent_output`;
  except `aten.index.Tensor` with integer indices, whose output has the indices' shape (the op
  carries the tag for its boolean form);
- indexing or `index_put_` with a bool / uint8 index tensor: `t[mask]`, `t[mask] = x`. Those
  run nonzero inside the kernel, below the mode, so the index dtype is what gives them away;
- a copy from a non-CPU device to the CPU (`.cpu()`, `.to("cpu")`, `cpu_t.copy_(cuda_t)`),
  and any other op that reads a non-CPU tensor and returns a CPU one.

Ops run on CPU tensors in the tests, so the mode judges the op, not the device it ran on.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

# Ops that return a host value computed from the data.
_HOST_VALUE = {aten._local_scalar_dense.default, aten.item.default, aten.equal.default}
_SYNC_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
             aten._index_put_impl_.default, aten._unsafe_index.Tensor,
             aten._unsafe_index_put.default}
_COPIES = {aten._to_copy.default, aten.copy_.default, aten.copy.default,
           aten._copy_from.default, aten._copy_from_and_resize.default}
_MASK_DTYPES = (torch.bool, torch.uint8)


class HostSyncError(RuntimeError):
    """An op that would make the host wait for the device ran under forbid_host_syncs()."""


def _tensors(tree: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _off_cpu(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in tensors if t.device.type != "cpu"]


def _copy_to_cpu(func, args: tuple, kwargs: dict) -> bool:  # noqa: ANN001 - an OpOverload
    """Before the op runs: does this copy op move data from another device to the CPU?"""
    if func is aten._to_copy.default:
        device = kwargs.get("device")
        return (device is not None and torch.device(device).type == "cpu"
                and args[0].device.type != "cpu")
    if func in (aten.copy_.default, aten.copy.default):  # copy_(self=destination, src)
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    if func in (aten._copy_from.default, aten._copy_from_and_resize.default):  # (src, dst)
        return args[1].device.type == "cpu" and args[0].device.type != "cpu"
    return False


def host_sync_reason(func, args: tuple, kwargs: dict) -> str | None:  # noqa: ANN001
    """Why `func(*args, **kwargs)` would sync the host with the device, or None."""
    if func in _HOST_VALUE:
        return "returns a host value read from the data"
    if func in _INDEXING:
        indices = _tensors(args[1:2])  # index(self, indices), index_put_(self, indices, values)
        if any(t.dtype in _MASK_DTYPES for t in indices):
            return "indexes with a boolean mask (runs nonzero inside the kernel)"
        return None  # integer indices: the output has the indices' shape
    for tag in _SYNC_TAGS:
        if tag in func.tags:
            return f"is tagged {tag.name}: its output depends on the data"
    if func in _COPIES and _copy_to_cpu(func, args, kwargs):
        return "copies a non-CPU tensor to the CPU"
    return None


class _ForbidHostSyncs(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        reason = host_sync_reason(func, args, kwargs)
        if reason is not None:
            raise HostSyncError(f"host sync: {func} {reason}")
        out = func(*args, **kwargs)
        if _off_cpu(_tensors((args, kwargs))) and not _off_cpu(_tensors(out)) and _tensors(out):
            raise HostSyncError(f"host sync: {func} read a non-CPU tensor and returned a CPU one")
        return out


def forbid_host_syncs() -> TorchDispatchMode:
    """A context manager: every aten op inside it that would sync the host raises
    HostSyncError naming the op (see the module docstring for what counts)."""
    return _ForbidHostSyncs()
