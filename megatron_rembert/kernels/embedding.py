"""Embedding lookup whose backward costs what the batch's tokens cost.

`F.embedding`'s backward materialises a dense V x E gradient (zero-filled, then each token's
row added in): for RemBERT's 250k x 256 table that is 64M elements written per micro-batch
whatever the number of tokens, and the trainer then adds all of them into its fp32 gradient
buffer. `embedding_into_main_grad` adds each token's gradient row straight into that buffer
(`main_grad`: fp32, V_local x E, set by parallel/grad_buffer.py) and hands autograd no gradient
for the table: T x E work for T tokens, in fp32 from the first addition. `on_added()` is called
once the backward has added its rows: the buffer's count of the table's gradient, which
autograd, handed none, cannot be relied on to report.

The addition is deterministic on both devices: `index_add_` on CPU; on CUDA, where
`index_add_` uses atomics (run-to-run differences in the last bit), `index_put_` with
`accumulate=True`, which sorts the indices first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def add_rows_(main_grad: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """main_grad[ids[t]] += rows[t] for every t, deterministically. main_grad: V x E fp32;
    ids: T int64; rows: T x E (cast to fp32)."""
    rows = rows.to(main_grad.dtype)
    if main_grad.is_cuda:
        main_grad.index_put_((ids,), rows, accumulate=True)
    else:
        main_grad.index_add_(0, ids, rows)


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, main_grad, padding_idx, on_added):  # noqa: ANN001
        ctx.save_for_backward(ids)
        ctx.main_grad, ctx.padding_idx, ctx.on_added = main_grad, padding_idx, on_added
        return F.embedding(ids, weight)  # ids.shape x E

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        (ids,) = ctx.saved_tensors
        flat = ids.reshape(-1)  # T
        rows = grad.reshape(-1, grad.shape[-1])  # T x E
        if ctx.padding_idx is not None:  # as F.embedding: the padding row takes no gradient
            rows = rows.masked_fill((flat == ctx.padding_idx).unsqueeze(1), 0.0)
        add_rows_(ctx.main_grad, flat, rows)
        if ctx.on_added is not None:
            ctx.on_added()
        return None, None, None, None, None


def embedding_into_main_grad(ids: torch.Tensor, weight: torch.Tensor, main_grad: torch.Tensor,
                             padding_idx: int | None = None,
                             on_added: Callable[[], None] | None = None) -> torch.Tensor:
    """`F.embedding(ids, weight, padding_idx)` whose gradient for `weight` is added into
    `main_grad` (same shape as weight, fp32) during backward instead of returned; then
    `on_added()`."""
    if main_grad.shape != weight.shape:
        raise ValueError(f"main_grad has shape {tuple(main_grad.shape)}, weight "
                         f"{tuple(weight.shape)}")
    return _EmbeddingIntoMainGrad.apply(ids, weight, main_grad, padding_idx, on_added)
