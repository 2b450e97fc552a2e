"""Vocab-parallel softmax cross-entropy: each TP rank holds a slice of the vocabulary.

Per row, the shards' max, sum-exp and target logit are combined by two small all-reduces (one
MAX, one SUM over a stacked [sum-exp, target] tensor); the full vocabulary is never gathered.

Two paths compute the same thing:
- `vocab_parallel_cross_entropy(logits, ...)`: plain torch on this shard's logits for all rows;
  the reference the fused path is tested against;
- `fused_vocab_parallel_linear_cross_entropy(hidden, weight, bias, ...)`: the output projection
  fused with the loss, chunked over rows so that logits for all rows exist only within the
  kept-logits budget (megatron_rembert.kernels.cross_entropy; Triton on GPU). The collectives
  are injected here, so the kernel module stays free of process groups.
Both run at static shapes (no host sync): every row is computed, and rows with weight 0 are
masked with `torch.where` to loss 0, gradient 0, never correct, whatever their target id.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_rembert.kernels.cross_entropy import linear_cross_entropy
from megatron_rembert.parallel.mappings import all_reduce_


def _reduce_max(t: torch.Tensor) -> None:
    all_reduce_(t, op=dist.ReduceOp.MAX, tag="loss")


def _reduce_sum(t: torch.Tensor) -> None:
    all_reduce_(t, tag="loss")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, weights, vocab_start: int, n_valid: int):
        logits = logits.to(torch.float32, copy=True)  # N x V_local, a private copy to overwrite
        v_local = logits.shape[1]
        if n_valid < v_local:
            logits[:, n_valid:] = float("-inf")  # vocabulary padding takes no probability mass
        row_max = logits.max(dim=1).values  # N
        _reduce_max(row_max)
        logits -= row_max.unsqueeze(1)  # shifted logits: <= 0, the global max at 0
        active = weights != 0  # N
        local_target = targets - vocab_start  # N
        in_shard = active & (local_target >= 0) & (local_target < n_valid)  # N
        local_target = local_target.clamp(0, v_local - 1)
        rows = torch.arange(logits.shape[0], device=logits.device)
        target_logit = torch.where(in_shard, logits[rows, local_target], 0.0)  # N
        exp = logits.exp_()  # N x V_local, in place
        stats = torch.stack([exp.sum(dim=1), target_logit])  # 2 x N
        _reduce_sum(stats)
        sum_exp, target_logit = stats
        losses = torch.where(active, torch.log(sum_exp) - target_logit, 0.0)  # N
        correct = active & (target_logit >= 0)  # the target holds the global max
        exp /= sum_exp.unsqueeze(1)  # softmax, N x V_local
        ctx.save_for_backward(exp, local_target, in_shard, active)
        ctx.mark_non_differentiable(correct)
        return losses, correct

    @staticmethod
    def backward(ctx, grad_losses, _grad_correct):
        softmax, local_target, in_shard, active = ctx.saved_tensors
        grad = softmax.clone()  # N x V_local
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= in_shard.float()
        grad *= grad_losses.unsqueeze(1)
        grad = torch.where(active.unsqueeze(1), grad, 0.0)  # weight-0 rows: exactly 0
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 weights: torch.Tensor, vocab_start: int, n_valid: int
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy over the full (sharded) vocabulary from this rank's logits.

    logits: N x V_local (columns vocab_start .. vocab_start + V_local of the padded vocabulary;
    columns >= n_valid are padding); targets: N global ids; weights: N (rows with 0 give loss
    0, gradient 0, never correct; their targets may be any id). Returns (losses N fp32,
    correct N bool: the target has the highest logit). The gradient w.r.t. logits is this
    shard's part.
    """
    return _VocabParallelCrossEntropy.apply(logits, targets, weights, vocab_start, n_valid)


def fused_vocab_parallel_linear_cross_entropy(
        hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        targets: torch.Tensor, weights: torch.Tensor, vocab_start: int, n_valid: int,
        chunk_size: int | None = None, keep_logits_gib: float = 0.0,
        main_grads: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
        on_added: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output projection + cross-entropy for this vocabulary shard, without holding all logits.

    hidden: N x E (identical on the TP ranks; its gradient here is this shard's part, so the
    caller wraps it in `copy_to_tp`); weight: V_local x E; bias: V_local; targets: N global ids;
    weights: N (rows with 0 give loss 0, gradient 0, never correct). chunk_size: most rows per
    chunk (None: the device's tiling); keep_logits_gib: GiB of forward logits kept for
    backward instead of recomputed (see `linear_cross_entropy`); main_grads: fp32 buffers that
    backward adds grad_weight / grad_bias into instead of returning them, then calls
    `on_added()`. Returns (losses N fp32, correct N bool).
    """
    return linear_cross_entropy(hidden, weight, bias, targets, weights, vocab_start=vocab_start,
                                n_valid=n_valid, reduce_max=_reduce_max, reduce_sum=_reduce_sum,
                                chunk_size=chunk_size, keep_logits_gib=keep_logits_gib,
                                main_grads=main_grads, on_added=on_added)
