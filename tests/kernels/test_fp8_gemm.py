"""The fp8 GEMM off CUDA (`fp32_scaled_mm`) against torch's own `_scaled_mm` CPU kernel, the
reference: the same products of the same fp8 operands, equal up to the order of fp32 sums, at
every operand-format pair and output dtype the linears use, with power-of-two scales."""

from __future__ import annotations

import pytest
import torch

from megatron_rembert.kernels import fp8

E4M3, E5M2 = fp8.E4M3, fp8.E5M2


def _operand(rows: int, cols: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    t = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 3
    scale = fp8.scale_for(fp8.amax(t), dtype)
    return fp8.quantize(t, scale, dtype), 1 / scale


@pytest.mark.parametrize("formats", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(48, 64, 32), (256, 128, 512), (16, 512, 128)])
def test_fp32_gemm_equals_torchs_scaled_mm(formats, out_dtype, shape):
    m, k, n = shape
    a, a_inv = _operand(m, k, formats[0], 1)
    b_t, b_inv = _operand(n, k, formats[1], 2)
    b = fp8.col_major(b_t.t())
    ours = fp8.fp32_scaled_mm(a, b, a_inv, b_inv, out_dtype)
    ref = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)
    assert ours.dtype == ref.dtype == out_dtype and ours.shape == ref.shape == (m, n)
    if out_dtype == torch.float32:
        # sums of k exact products, in another order: a few fp32 rounding steps apart
        torch.testing.assert_close(ours, ref, rtol=0, atol=k * 2e-7 * ref.abs().max().item())
    else:  # the same fp32 sum rounded once: at most one bf16 step apart, rarely
        ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp(min=1e-30)
        assert ((ours.float() - ref.float()).abs() <= ulp).all()
        assert (ours != ref).float().mean() < 0.01
    assert ref.abs().max() > 0


def test_cpu_uses_the_fp32_gemm_and_cuda_torchs():
    assert fp8._gemm(torch.device("cpu")) is fp8.fp32_scaled_mm
    assert fp8._gemm(torch.device("cuda")) is torch._scaled_mm
