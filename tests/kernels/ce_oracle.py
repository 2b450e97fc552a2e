"""Independent oracle for linear_cross_entropy: full logits and plain F.cross_entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # the oracle's ignore_index


def padding_targets(n: int, n_valid: int) -> torch.Tensor:
    """Targets for n weight-0 rows: any id, since the data pipeline gives padding slots any
    label. A valid id (whose one-hot a careless mask would subtract), -100, a padding column,
    an id far beyond the vocabulary, in turn."""
    choices = torch.tensor([max(n_valid - 1, 0), IGNORE, n_valid + 3, 10**9])
    return choices[torch.arange(n) % len(choices)]

# dtype -> (atol, rtol)
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-3, 5e-2)}


def make_inputs(n: int, e: int, v: int, n_valid: int, dtype: torch.dtype, bias: bool,
                seed: int = 0, zero_frac: float = 0.25) -> dict:
    """Random problem with logits of order 1; weight-0 rows carry any target id."""
    g = torch.Generator().manual_seed(seed)
    weights = (torch.rand(n, generator=g) >= zero_frac).float() * 2.0  # N, 0 or 2
    targets = torch.randint(0, max(n_valid, 1), (n,), generator=g)  # N
    padding = weights == 0
    targets[padding] = padding_targets(int(padding.sum()), n_valid)
    return dict(
        hidden=torch.randn(n, e, generator=g).to(dtype),  # N x E
        weight=(torch.randn(v, e, generator=g) / e**0.5).to(dtype),  # V x E
        bias=(torch.randn(v, generator=g) * 0.1).to(dtype) if bias else None,  # V
        targets=targets,
        weights=weights,
        grad_out=torch.rand(n, generator=g),  # N, upstream gradient of each loss
    )


def full_logits_reference(hidden, weight, bias, targets, weights, grad_out, n_valid):  # noqa: ANN001, ANN201
    """Loss, correct and gradients from the full N x n_valid logits (computed in the input
    dtype like the op's matmul, then upcast) through F.cross_entropy."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    b = bias.detach().clone().requires_grad_() if bias is not None else None
    logits = h @ w.t() if b is None else torch.addmm(b, h, w.t())  # N x V
    logits = logits[:, :n_valid].float()  # N x n_valid: padding columns dropped
    tgt = torch.where(weights != 0, targets, torch.full_like(targets, IGNORE))
    losses = F.cross_entropy(logits, tgt, reduction="none", ignore_index=IGNORE)  # N
    (losses * grad_out).sum().backward()
    picked = logits.gather(1, tgt.clamp(min=0)[:, None]).squeeze(1)  # N
    correct = (picked >= logits.amax(dim=1)) & (weights != 0)
    grads = [h.grad, w.grad, None if b is None else b.grad]
    return losses.detach(), correct, grads
