"""Fused scale + key-mask + softmax for attention scores, forward and backward.

    probs = softmax(scores * scale, over keys, masked keys excluded)

One Triton program handles one row (one query of one head) with BLOCK = next power of two of
Sk (at least MIN_BLOCK), so any key length up to MAX_KEYS works with no divisibility
conditions. Math is fp32 for every input dtype; probabilities are stored in the input dtype.
A fully masked row yields zeros (not NaN) in forward and a zero gradient in backward.

Backward uses only the saved probabilities:  dx = scale * p * (dy - sum_k(dy * p)).

Dispatch: CUDA tensors -> Triton; CPU tensors -> the torch reference below (also the test
oracle). ``backend="triton"`` forces the Triton path (on CPU only under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from megatron_rembert.kernels.aot import FLOAT_TYPES, KernelConfig, kernel_config

try:  # triton is optional: the torch path must work where it is missing (e.g. macOS)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None

# One program holds a whole row in registers; 4096 fp32 values is the largest row that still
# fits comfortably (8 warps x 32 threads x 16 values). Longer rows need a looped kernel.
MAX_KEYS = 4096
# Narrowest row block: one warp's 32 lanes. A narrower block would only leave lanes idle, and
# every distinct block size is one more kernel to compile (and to check in CI).
MIN_BLOCK = 32

if triton is not None:

    @triton.jit
    def _softmax_fwd_kernel(
        x_ptr, mask_ptr, p_ptr, Sk, rows_per_batch, scale,
        HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        in_row = cols < Sk
        x = tl.load(x_ptr + row * Sk + cols, mask=in_row, other=0.0).to(tl.float32) * scale
        keep = in_row
        if HAS_MASK:
            batch = row // rows_per_batch
            key_ok = tl.load(mask_ptr + batch * Sk + cols, mask=in_row, other=0)
            keep = keep & (key_ok != 0)
        x = tl.where(keep, x, float("-inf"))
        row_max = tl.max(x, axis=0)
        # fully masked row: max is -inf; shift by 0 instead so exp(-inf) = 0 (no inf - inf)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        e = tl.exp(x - row_max)
        denom = tl.sum(e, axis=0)
        p = e / tl.where(denom > 0, denom, 1.0)
        tl.store(p_ptr + row * Sk + cols, p.to(p_ptr.dtype.element_ty), mask=in_row)

    @triton.jit
    def _softmax_bwd_kernel(p_ptr, dy_ptr, dx_ptr, Sk, scale, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        in_row = cols < Sk
        p = tl.load(p_ptr + row * Sk + cols, mask=in_row, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * Sk + cols, mask=in_row, other=0.0).to(tl.float32)
        dot = tl.sum(p * dy, axis=0)
        dx = scale * p * (dy - dot)
        tl.store(dx_ptr + row * Sk + cols, dx.to(dx_ptr.dtype.element_ty), mask=in_row)


def _block(sk: int) -> int:
    """Row block of both launchers: the next power of two >= Sk, at least MIN_BLOCK."""
    return max(MIN_BLOCK, triton.next_power_of_2(sk))


def _num_warps(block: int) -> int:
    return 1 if block <= 128 else 4 if block <= 1024 else 8


def aot_configs() -> list[KernelConfig]:
    """Every kernel configuration the launchers below can choose, for the AOT compile test."""
    configs = []
    for block in sorted({_block(sk) for sk in range(1, MAX_KEYS + 1)}):
        warps = _num_warps(block)
        for dt in FLOAT_TYPES.values():
            for has_mask in (False, True):
                mask_t = "*i8" if has_mask else f"*{dt}"  # without a mask the launcher passes x
                configs.append(kernel_config(
                    _softmax_fwd_kernel, warps,
                    {"x_ptr": f"*{dt}", "mask_ptr": mask_t, "p_ptr": f"*{dt}", "Sk": "i32",
                     "rows_per_batch": "i32", "scale": "fp32"},
                    HAS_MASK=has_mask, BLOCK=block,
                ))
            configs.append(kernel_config(
                _softmax_bwd_kernel, warps,
                {"p_ptr": f"*{dt}", "dy_ptr": f"*{dt}", "dx_ptr": f"*{dt}", "Sk": "i32",
                 "scale": "fp32"},
                BLOCK=block,
            ))
    return configs


# ---------------------------------------------------------------- torch reference
def softmax_forward_torch(
    scores: torch.Tensor, key_mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Reference forward. scores: B x heads x Sq x Sk; key_mask: B x Sk bool or None."""
    x = scores.float() * scale  # B x H x Sq x Sk, fp32
    if key_mask is not None:
        x = x.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    row_max = x.amax(dim=-1, keepdim=True)  # B x H x Sq x 1
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    e = torch.exp(x - row_max)  # B x H x Sq x Sk
    denom = e.sum(dim=-1, keepdim=True)  # B x H x Sq x 1
    return (e / torch.where(denom > 0, denom, torch.ones_like(denom))).to(scores.dtype)


def softmax_backward_torch(probs: torch.Tensor, grad: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference backward from the saved probabilities (any shape, last dim = keys)."""
    p, dy = probs.float(), grad.float()  # ... x Sk, fp32
    dot = (p * dy).sum(dim=-1, keepdim=True)  # ... x 1
    return (scale * p * (dy - dot)).to(grad.dtype)


# ---------------------------------------------------------------- Triton launchers
def _require_triton() -> None:
    if triton is None:
        raise RuntimeError(
            "backend='triton' needs the triton package; install it or use backend='torch'"
        )


def softmax_forward_triton(
    scores: torch.Tensor, key_mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    _require_triton()
    B, H, Sq, Sk = scores.shape
    x = scores.contiguous()  # B x H x Sq x Sk
    p = torch.empty_like(x)  # B x H x Sq x Sk
    if x.numel() == 0:
        return p
    block = _block(Sk)
    mask = key_mask.contiguous().to(torch.int8) if key_mask is not None else x  # B x Sk
    _softmax_fwd_kernel[(B * H * Sq,)](
        x, mask, p, Sk, H * Sq, float(scale),
        HAS_MASK=key_mask is not None, BLOCK=block, num_warps=_num_warps(block),
    )
    return p


def softmax_backward_triton(probs: torch.Tensor, grad: torch.Tensor, scale: float) -> torch.Tensor:
    _require_triton()
    Sk = probs.shape[-1]
    p, dy = probs.contiguous(), grad.contiguous().to(probs.dtype)  # B x H x Sq x Sk
    dx = torch.empty_like(p)  # B x H x Sq x Sk
    if p.numel() == 0:
        return dx
    block = _block(Sk)
    _softmax_bwd_kernel[(p.numel() // Sk,)](
        p, dy, dx, Sk, float(scale), BLOCK=block, num_warps=_num_warps(block)
    )
    return dx


# ---------------------------------------------------------------- autograd + public API
class _FusedScaleMaskSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, key_mask, scale, use_triton):  # noqa: ANN001
        fwd = softmax_forward_triton if use_triton else softmax_forward_torch
        probs = fwd(scores, key_mask, scale)  # B x H x Sq x Sk, input dtype
        ctx.save_for_backward(probs)
        ctx.scale, ctx.use_triton = scale, use_triton
        return probs

    @staticmethod
    def backward(ctx, grad_probs):  # noqa: ANN001
        (probs,) = ctx.saved_tensors
        bwd = softmax_backward_triton if ctx.use_triton else softmax_backward_torch
        return bwd(probs, grad_probs, ctx.scale), None, None, None


def _use_triton(backend: str, device: torch.device) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "auto":
        return device.type == "cuda" and triton is not None
    return backend == "triton"


def fused_scale_mask_softmax(
    scores: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """softmax(scores * scale) over the last dim with masked keys excluded.

    Args:
        scores: B x heads x Sq x Sk, fp32 / bf16 / fp16.
        key_mask: B x Sk bool, True = attend; None attends to every key.
        scale: multiplier applied before the softmax (usually 1 / sqrt(head_dim)).
        backend: "auto" (CUDA -> Triton, CPU -> torch), "triton" or "torch".

    Returns:
        probs: B x heads x Sq x Sk in the input dtype (fp32 math); fully masked rows are 0.
    """
    if scores.dim() != 4:
        raise ValueError(f"scores must be B x heads x Sq x Sk, got shape {tuple(scores.shape)}")
    B, _, _, Sk = scores.shape
    if key_mask is not None and (key_mask.shape != (B, Sk) or key_mask.dtype != torch.bool):
        raise ValueError(
            f"key_mask must be a bool tensor of shape (B, Sk) = {(B, Sk)}, "
            f"got {key_mask.dtype} {tuple(key_mask.shape)}"
        )
    use_triton = _use_triton(backend, scores.device)
    if use_triton and Sk > MAX_KEYS:
        raise ValueError(f"the Triton softmax supports Sk <= {MAX_KEYS}, got Sk = {Sk}")
    return _FusedScaleMaskSoftmax.apply(scores, key_mask, float(scale), use_triton)
