"""The MLM head, run only at masked positions, and its vocab-parallel loss.

H -> E_out dense, GELU, LayerNorm(E_out), then the output embedding E_out -> V with bias. With
V = 250k and E_out = 1664 the output projection would be ~40% of the model's FLOPs on every
position; gathering the P masked positions of each sequence first makes it ~6%.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron_rembert.config import ModelConfig
from megatron_rembert.parallel import state
from megatron_rembert.parallel.cross_entropy import (
    fused_vocab_parallel_linear_cross_entropy,
    vocab_parallel_cross_entropy,
)
from megatron_rembert.parallel.layers import VocabParallelEmbedding, VocabParallelOutput
from megatron_rembert.parallel.mappings import copy_to_tp


class MLMLoss(NamedTuple):
    """Sums over this rank's real masked tokens; the trainer divides by the global count.

    loss_sum: sum of per-token cross-entropies (weighted by masked_weights); num_tokens: sum of
    masked_weights; num_correct: tokens whose target has the highest logit.

    A tuple on purpose: DeepSpeed hooks the backward of the tensors it finds in a forward's
    output (tensors, tuples, lists, dicts) to start each micro-batch's backward (its bf16
    optimizer clears the previous micro-batch's bf16 gradients there); inside a dataclass it
    finds nothing, and the gradients of every micro-batch were summed again at each later one.
    """

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    num_correct: torch.Tensor


def gather_positions(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """hidden: B x S x H, positions: B x P -> (B*P) x H."""
    index = positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])  # B x P x H
    return hidden.gather(1, index).reshape(-1, hidden.shape[-1])


def _summed_by_kernels(param: torch.Tensor | None) -> bool:
    """Whether the trainer's gradient buffer has `param`'s gradient summed by the loss kernel
    (parallel/grad_buffer.py: `main_grad`, and `main_grad_added` to report it)."""
    return (param is not None and param.requires_grad
            and getattr(param, "main_grad_added", None) is not None)


class MLMHead(nn.Module):
    def __init__(self, config: ModelConfig, tied_embedding: VocabParallelEmbedding | None = None):
        super().__init__()
        e_out = config.output_embedding_size
        self.loss_backend = config.loss_backend
        self.loss_chunk_rows = config.loss_chunk_rows or None  # 0: the device's default
        self.loss_keep_logits_gib = config.loss_keep_logits_gib
        self.dense = nn.Linear(config.hidden_size, e_out)
        self.layer_norm = nn.LayerNorm(e_out, eps=config.layer_norm_eps)
        self.decoder = VocabParallelOutput(config.padded_vocab_size(state.tp_size()), e_out,
                                           config.vocab_size)
        if tied_embedding is not None:
            # Coupled baselines: the decoder reuses the input table (same shape and sharding);
            # only the bias is its own.
            self.decoder.weight = tied_embedding.weight

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        """N x H -> N x E_out, replicated on the TP ranks."""
        return self.layer_norm(F.gelu(self.dense(hidden)))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """N x H -> N x V_local: this rank's logits, padding columns included (tests, export)."""
        return F.linear(self.transform(hidden), self.decoder.weight, self.decoder.bias)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
                ) -> MLMLoss:
        """hidden: N x H at masked positions; labels: N global ids; weights: N (0 = padding,
        any label). Runs at static shapes: no host sync."""
        weights = weights.float()
        x = copy_to_tp(self.transform(hidden))  # N x E_out; each shard adds its grad part
        dec = self.decoder
        if self.loss_backend == "fused":
            # Under the trainer's fp32 main gradients (parallel/grad_buffer.py) the output
            # embedding's gradient is summed straight into them: no V_local x E gradient in the
            # weight's dtype, no conversion afterwards.
            summed = [p for p in (dec.weight, dec.bias)
                      if torch.is_grad_enabled() and _summed_by_kernels(p)]
            main_grads = tuple(p.main_grad if any(p is q for q in summed) else None
                               for p in (dec.weight, dec.bias))

            def added() -> None:
                for p in summed:
                    p.main_grad_added()

            losses, correct = fused_vocab_parallel_linear_cross_entropy(
                x, dec.weight, dec.bias, labels, weights, dec.vocab_start, dec.n_valid,
                self.loss_chunk_rows, self.loss_keep_logits_gib, main_grads,
                added if summed else None)
        else:
            logits = F.linear(x, dec.weight, dec.bias)  # N x V_local
            losses, correct = vocab_parallel_cross_entropy(logits, labels, weights,
                                                           dec.vocab_start, dec.n_valid)
        # both losses are 0 and never correct at weight-0 rows (masked inside, whatever the
        # label): no mask here, and no op whose shape depends on the data
        return MLMLoss(loss_sum=(losses * weights).sum(), num_tokens=weights.sum(),
                       num_correct=correct.sum())
