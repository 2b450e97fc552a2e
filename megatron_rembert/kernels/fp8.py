"""FP8 quantisation and the scaled GEMM (`torch._scaled_mm`) in the layouts CUDA accepts.

    t_fp8 = saturate(t * scale) in an fp8 format,    scale = 2^floor(log2(fp8_max / amax(t)))
    a @ b  ~=  _scaled_mm(a_fp8, b_fp8, 1 / scale_a, 1 / scale_b)  (fp32 accumulation)

One scale per tensor, computed from the tensor itself (dynamic scaling: no amax history to
keep, checkpoint or reshard). The scale is a power of two: multiplying by it is exact in any
float format, so quantising a bf16 tensor rounds once (the cast to fp8), and its reciprocal,
which `_scaled_mm` takes, is exact too.

Formats (the usual recipe): float8_e4m3fn (3 mantissa bits, max 448) for weights and
activations, float8_e5m2 (2 mantissa bits, max 57344) for gradients, whose range matters more
than their precision.

`_scaled_mm` on CUDA takes mat1 row-major and mat2 column-major, with the reduction dimension
and mat2's columns multiples of GEMM_MULTIPLE; the CPU kernel checks none of this, so every
call here builds those layouts explicitly (`row_major`, `col_major`) and a CPU test asserts
the strides it passes. Off CUDA the product is `fp32_scaled_mm`: torch's CPU `_scaled_mm` is a
slow reference (about 100x slower than an fp32 matmul at the model's sizes), and fp8 values
and their products are exact in fp32, so the fp32 GEMM computes the same numbers up to the
order of the fp32 sums (tests/kernels/test_fp8_gemm.py holds the two against each other).
Per-tensor math only: the all-reduce that agrees a scale over the TP group lives in
parallel/fp8.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn  # weights and activations
E5M2 = torch.float8_e5m2  # gradients
# cuBLASLt's fp8 GEMMs need the reduction dimension and mat2's columns in multiples of 16.
GEMM_MULTIPLE = 16
# amax below this (an all-zero tensor) is raised to it: the scale stays finite (2^48 for e4m3).
AMAX_FLOOR = 1e-12


def amax(t: torch.Tensor) -> torch.Tensor:
    """max |t| as an fp32 scalar on t's device (no host sync)."""
    return t.abs().amax().float()


def scale_for(t_amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The largest power of two that maps `t_amax` into the format's range (fp32 scalar)."""
    fp8_max = torch.finfo(fp8_dtype).max
    return torch.exp2(torch.floor(torch.log2(fp8_max / t_amax.clamp(min=AMAX_FLOOR))))


def quantize(t: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """saturate(t * scale) in `fp8_dtype`, same shape. The product is exact in t's own dtype
    (a power-of-two scale), so no fp32 copy of t is made; the clamp only matters for a
    non-power-of-two scale or a non-finite t (e4m3fn has no infinity: an overflow is NaN)."""
    fp8_max = torch.finfo(fp8_dtype).max
    return (t * scale.to(t.dtype)).clamp(-fp8_max, fp8_max).to(fp8_dtype)


def pad_rows(t: torch.Tensor, multiple: int = GEMM_MULTIPLE) -> torch.Tensor:
    """t (M x K) with zero rows appended up to a multiple of `multiple` (t itself if none are
    needed). Zero rows add nothing to a product that reduces over M (the weight gradient)."""
    missing = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, missing)) if missing else t


def is_row_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) == t.shape[1]


def is_col_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(0) == 1 and t.stride(1) == t.shape[0]


def row_major(t: torch.Tensor) -> torch.Tensor:
    """t with strides (cols, 1), copied only if it has others."""
    return t if is_row_major(t) else t.contiguous()


def col_major(t: torch.Tensor) -> torch.Tensor:
    """t with strides (1, rows), copied only if it has others (a transposed row-major tensor
    already has them)."""
    return t if is_col_major(t) else t.t().contiguous().t()


def fp32_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                   scale_b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`torch._scaled_mm`'s product computed as an fp32 GEMM: the fp8 operands widened
    (exactly), multiplied and summed in fp32, scaled, rounded once to `out_dtype`."""
    return ((a.float() @ b.float()) * (scale_a * scale_b)).to(out_dtype)


def _gemm(device: torch.device):
    """The fp8 GEMM for `device`: cuBLASLt's through `torch._scaled_mm` on CUDA, the fp32 GEMM
    elsewhere."""
    return torch._scaled_mm if device.type == "cuda" else fp32_scaled_mm


def scaled_mm(a: torch.Tensor, b: torch.Tensor, a_inv_scale: torch.Tensor,
              b_inv_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """(a / scale_a) @ (b / scale_b) in `out_dtype`: a (M x K) and b (K x N) fp8, passed
    row-major and column-major; at most one of them e5m2 (cuBLASLt has no e5m2 x e5m2)."""
    if a.dtype == b.dtype == E5M2:
        raise ValueError("scaled_mm: both operands e5m2, which CUDA's fp8 GEMM refuses")
    return _gemm(a.device)(row_major(a), col_major(b), scale_a=a_inv_scale,
                           scale_b=b_inv_scale, out_dtype=out_dtype)
