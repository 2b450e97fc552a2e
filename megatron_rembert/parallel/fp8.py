"""FP8 GEMMs for the Transformer layers' column- and row-parallel linears (`train.fp8`).

Each of the three GEMMs of a linear runs through `torch._scaled_mm` (kernels/fp8.py):
    forward       Y  = X @ W^T        X, W in e4m3
    grad-input    dX = dY @ W         dY in e5m2, W in e4m3
    grad-weight   dW = dY^T @ X       dY in e5m2, X in e4m3 (the copy saved in forward)
with one dynamic power-of-two scale per tensor. The weights stay the bf16 parameters DeepSpeed
keeps fp32 masters of; their fp8 copies are a cache (below), never saved: optimizer state and
checkpoints are those of a bf16 run. Biases are added outside the GEMM, in the layer.

Tensor parallelism: each TP rank scales its own shard, with no collective, and still
quantises as one process does. The formats are floating point and the scales powers of two,
so a scale moves every element's exponent and leaves its rounding alone: a shard scaled by
its own amax rounds each element exactly as the whole tensor's scale would, except elements
that fall below the format's smallest normal number under one scale and not the other
(|v| < 7e-5 amax for e4m3, 2e-9 amax for e5m2), whose values then differ by less than
4.4e-6 amax (e4m3). A tp = 2 run matches one process to 1e-4 (tests/parallel/test_fp8.py,
also with shards of very different size). Agreeing the scales over the TP group (an amax
all-reduce) would remove even that, for 2 all-reduces per layer in forward and 4 in backward,
each one-float and in front of its GEMM (latency on the critical path); with power-of-two
scales it buys nothing measurable, so fp8 adds no collective: the communication plan is
bf16's (one all-reduce per attention and FFN block each way).

Weight cache: a weight changes once per optimizer step, so its e4m3 copy, the transposed copy
grad-input needs (column-major mat2) and its scale are kept until it changes. A copy is stale
when the weight's `_version`, storage or dtype changed, or when the cache was invalidated:
DeepSpeed writes the updated bf16 weights through `.data` (which does not move `_version`)
right after its wrapped optimizer's `step()`, and torch's fused AdamW moves no `_version`
either, so the owner of a model ties its caches to the optimizer that updates its weights
(`follow_optimizer`: a hook on that one optimizer) or calls `invalidate_weight_cache(gemms)`
after writing weights itself. Nothing is process-wide: a second model, fp8 or not, and its
optimizer never touch this model's caches. Memory: 2 bytes per weight element (two fp8 copies).

model.compile: the fp8 GEMM is left out of the compiled graph (`torch.compiler.disable`: its
cache is Python state dynamo cannot guard); the rest of each layer compiles around it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from megatron_rembert.kernels.fp8 import (
    E4M3,
    E5M2,
    GEMM_MULTIPLE,
    amax,
    pad_rows,
    quantize,
    scale_for,
    scaled_mm,
)
from megatron_rembert.parallel.layers import ColumnParallelLinear, RowParallelLinear


@dataclass
class Fp8Weight:
    data: torch.Tensor  # N x K e4m3, row-major: the forward's mat2 as data.t()
    data_t: torch.Tensor  # K x N e4m3, row-major: grad-input's mat2 (N x K column-major) as .t()
    inv_scale: torch.Tensor  # fp32 scalar

    @classmethod
    @torch.no_grad()
    def of(cls, weight: torch.Tensor) -> Fp8Weight:
        scale = scale_for(amax(weight), E4M3)
        data = quantize(weight, scale, E4M3)  # N x K
        return cls(data, data.t().contiguous(), scale.reciprocal())


class _Fp8Linear(torch.autograd.Function):
    """y = x @ W^T through fp8 GEMMs, x: M x K (this rank's shard, scaled on its own)."""

    @staticmethod
    def forward(ctx, x, weight, w8, w8_t, w_inv):
        m = x.shape[0]
        x_scale = scale_for(amax(x), E4M3)
        # Rows padded to a multiple of 16 (zeros) for grad-weight, which reduces over them.
        x8 = quantize(pad_rows(x), x_scale, E4M3)  # M_pad x K
        ctx.save_for_backward(x8, x_scale, w8_t, w_inv)
        ctx.weight_dtype = weight.dtype
        return scaled_mm(x8[:m], w8.t(), x_scale.reciprocal(), w_inv, x.dtype)  # M x N

    @staticmethod
    def backward(ctx, grad):  # M x N
        x8, x_scale, w8_t, w_inv = ctx.saved_tensors
        g_scale = scale_for(amax(grad), E5M2)
        g8 = quantize(pad_rows(grad), g_scale, E5M2)  # M_pad x N
        g_inv = g_scale.reciprocal()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_mm(g8[:grad.shape[0]], w8_t.t(), g_inv, w_inv, grad.dtype)  # M x K
        if ctx.needs_input_grad[1]:
            # N x M_pad times M_pad x K: the padded rows are zeros in both.
            grad_w = scaled_mm(g8.t(), x8, g_inv, x_scale.reciprocal(), ctx.weight_dtype)
        return grad_x, grad_w, None, None, None


class Fp8Gemm:
    """The GEMM of one column- or row-parallel linear in fp8, `gemm(x, weight)` -> x @ W^T,
    with the weight's fp8 copy cached. A plain attribute of the layer (not a module: no
    parameters, buffers or state-dict keys)."""

    def __init__(self):
        self._weight: Fp8Weight | None = None
        self._key: tuple | None = None
        self._generation = 0  # bumped by invalidate(): the cached copy is stale
        self.refreshes = 0  # how many times the weight was quantised (tests read it)
        # Made here, not as a decorator: `torch.compiler.disable` imports dynamo (about 1 s
        # of every process's start-up), which a run without fp8 never needs.
        self._outside_graph = torch.compiler.disable(self._gemm)

    def invalidate(self) -> None:
        """The weight is re-quantised at its next use."""
        self._generation += 1

    def cached_weight(self, weight: torch.Tensor) -> Fp8Weight:
        key = (self._generation, weight._version, weight.data_ptr(), weight.dtype)
        if key != self._key:
            self._weight, self._key = Fp8Weight.of(weight), key
            self.refreshes += 1
        return self._weight

    def __call__(self, x: torch.Tensor, weight: nn.Parameter) -> torch.Tensor:
        return self._outside_graph(x, weight)

    def _gemm(self, x: torch.Tensor, weight: nn.Parameter) -> torch.Tensor:
        w = self.cached_weight(weight)
        # 2-D in and out: a view made inside a custom Function could not be all-reduced in
        # place (reduce_from_tp) afterwards.
        y = _Fp8Linear.apply(x.reshape(-1, x.shape[-1]), weight, w.data, w.data_t,
                             w.inv_scale)  # M x N
        return y.view(*x.shape[:-1], y.shape[-1])


def fp8_dims_problem(in_features: int, out_features: int) -> str | None:
    """Why a linear's local GEMM cannot run in fp8 on CUDA, or None."""
    if in_features % GEMM_MULTIPLE or out_features % GEMM_MULTIPLE:
        return (f"{out_features} x {in_features} weight: fp8 GEMMs need both dimensions "
                f"multiples of {GEMM_MULTIPLE}")
    return None


def enable_fp8(layers: Iterable[nn.Module]) -> list[Fp8Gemm]:
    """Run the GEMMs of every column- and row-parallel linear inside `layers` in fp8; returns
    their Fp8Gemm objects. Raises ValueError naming a layer whose local dimensions are not
    multiples of 16 (run_config refuses such a config before: this guards other callers)."""
    linears = [(name, module) for layer in layers for name, module in layer.named_modules()
               if isinstance(module, (ColumnParallelLinear, RowParallelLinear))]
    for name, module in linears:
        problem = fp8_dims_problem(module.weight.shape[1], module.weight.shape[0])
        if problem:
            raise ValueError(f"fp8: layer {name or type(module).__name__}: {problem}")
    for _, module in linears:
        module.fp8_gemm = Fp8Gemm()
    return [module.fp8_gemm for _, module in linears]


def invalidate_weight_cache(gemms: Iterable[Fp8Gemm]) -> None:
    """Each of `gemms` re-quantises its weight at its next use: after a write to the weights
    that moves no `_version` (through `.data`, or torch's fused optimizers)."""
    for gemm in gemms:
        gemm.invalidate()


def follow_optimizer(gemms: Sequence[Fp8Gemm], optimizer: torch.optim.Optimizer
                     ) -> RemovableHandle:
    """Invalidate `gemms`' cached weights after every `step()` of `optimizer`, the optimizer
    whose step updates their weights (the one handed to DeepSpeed, which copies the new bf16
    weights right after it). A hook on that optimizer alone; remove it with the handle."""
    gemms = list(gemms)
    return optimizer.register_step_post_hook(lambda *_: invalidate_weight_cache(gemms))
