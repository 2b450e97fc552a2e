"""fused_scale_mask_softmax: Triton (interpreter) and torch paths against plain F.softmax."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_rembert.kernels.softmax import fused_scale_mask_softmax

# dtype -> (atol, rtol): fp32 is exact up to reduction order; bf16/fp16 round the output.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (5e-3, 5e-2),
    torch.float16: (1e-3, 1e-2),
}


def oracle(scores: torch.Tensor, key_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """F.softmax in fp32; rows with no key get 0 (F.softmax would give NaN there)."""
    x = scores.float() * scale  # B x H x Sq x Sk
    if key_mask is None:
        return F.softmax(x, dim=-1)
    any_key = key_mask.any(dim=1)  # B
    safe = key_mask | ~any_key[:, None]  # B x Sk: a fully masked row attends everywhere...
    p = F.softmax(x.masked_fill(~safe[:, None, None, :], float("-inf")), dim=-1)
    return p * any_key[:, None, None, None]  # ...and is then zeroed (gradient 0 as well)


def run(fn, scores, key_mask, scale, grad):  # noqa: ANN001, ANN201
    x = scores.detach().clone().requires_grad_()
    p = fn(x, key_mask, scale)
    p.backward(grad.to(p.dtype))
    return p.detach().float(), x.grad.float()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sk", [1, 7, 100, 300])
def test_matches_f_softmax(backend: str, dtype: torch.dtype, sk: int) -> None:
    torch.manual_seed(sk)
    B, H, Sq, scale = 3, 2, 5, 0.37
    scores = (torch.randn(B, H, Sq, sk) * 3).to(dtype)
    key_mask = torch.rand(B, sk) > 0.3
    key_mask[0, 0] = True  # batch 0 has at least one key
    key_mask[1] = False  # batch 1 is fully masked: zeros, not NaN
    grad = torch.randn(B, H, Sq, sk)

    def ours(x, m, s):  # noqa: ANN001, ANN202
        return fused_scale_mask_softmax(x, m, s, backend=backend)

    p, dx = run(ours, scores, key_mask, scale, grad)
    p_ref, dx_ref = run(oracle, scores, key_mask, scale, grad.to(dtype))
    atol, rtol = TOL[dtype]
    assert not torch.isnan(p).any() and not torch.isnan(dx).any()
    torch.testing.assert_close(p, p_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(dx, dx_ref, atol=atol, rtol=rtol)
    assert p[1].abs().max() == 0 and dx[1].abs().max() == 0
    assert (p[:, :, :, ~key_mask[0]][0] == 0).all()  # masked keys take no probability
    rows = p[0].sum(dim=-1)  # H x Sq: rows with keys sum to 1
    torch.testing.assert_close(rows, torch.ones_like(rows), atol=10 * atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_mask_and_backends_agree(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    scores = torch.randn(2, 3, 4, 33).to(dtype)
    grad = torch.randn_like(scores, dtype=torch.float32)
    p_tr, dx_tr = run(lambda x, m, s: fused_scale_mask_softmax(x, m, s, "triton"),
                      scores, None, 1.5, grad)
    p_th, dx_th = run(lambda x, m, s: fused_scale_mask_softmax(x, m, s, "torch"),
                      scores, None, 1.5, grad)
    p_ref, dx_ref = run(oracle, scores, None, 1.5, grad.to(dtype))
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(p_tr, p_th, atol=atol, rtol=rtol)
    torch.testing.assert_close(dx_tr, dx_th, atol=atol, rtol=rtol)
    torch.testing.assert_close(p_tr, p_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(dx_tr, dx_ref, atol=atol, rtol=rtol)


def test_long_rows_4096() -> None:
    torch.manual_seed(2)
    scores = torch.randn(1, 1, 2, 4096) * 4
    key_mask = torch.rand(1, 4096) > 0.5
    grad = torch.randn_like(scores)
    p, dx = run(lambda x, m, s: fused_scale_mask_softmax(x, m, s, "triton"),
                scores, key_mask, 0.125, grad)
    p_ref, dx_ref = run(oracle, scores, key_mask, 0.125, grad)
    torch.testing.assert_close(p, p_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dx, dx_ref, atol=1e-6, rtol=1e-5)


def test_bad_arguments_are_explained() -> None:
    scores = torch.randn(2, 1, 1, 5)
    with pytest.raises(ValueError, match="key_mask"):
        fused_scale_mask_softmax(scores, torch.ones(2, 4, dtype=torch.bool), 1.0)
    with pytest.raises(ValueError, match="backend"):
        fused_scale_mask_softmax(scores, None, 1.0, backend="cuda")
    with pytest.raises(ValueError, match="4096"):
        fused_scale_mask_softmax(torch.randn(1, 1, 1, 4097), None, 1.0, backend="triton")
