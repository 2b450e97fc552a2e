"""Post-LN (BERT-style) Transformer layer on tensor-parallel linears.

Communication per layer in forward: one all-reduce after the attention output projection and
one after the FFN output projection (both row-parallel); in backward, one at each block's
`copy_to_tp`. Nothing else.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_rembert.config import ModelConfig
from megatron_rembert.kernels.softmax import fused_scale_mask_softmax
from megatron_rembert.parallel import state
from megatron_rembert.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_rembert.parallel.mappings import copy_to_tp
from megatron_rembert.parallel.random import ensure_tp_stream, tp_rng


class SelfAttention(nn.Module):
    """Bidirectional multi-head attention; this TP rank holds num_heads / tp whole heads."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden = config.hidden_size
        self.local_heads = config.num_attention_heads // state.tp_size()
        self.head_dim = config.head_dim
        self.backend = config.attention_backend
        self.dropout_p = config.attention_probs_dropout_prob
        # Q, K and V stay separate layers (not one fused 3H GEMM): every weight then maps 1:1
        # to transformers' RemBERT and reshards by a plain split.
        self.query = ColumnParallelLinear(hidden, hidden)
        self.key = ColumnParallelLinear(hidden, hidden)
        self.value = ColumnParallelLinear(hidden, hidden)
        self.dense = RowParallelLinear(hidden, hidden)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)  # B x h x S x d

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """x: B x S x H; key_mask: B x S bool (True = real token), or None when no position is
        padding: SDPA without a mask may then use FlashAttention on CUDA (a boolean mask rules
        it out) -> B x S x H."""
        b, s, _ = x.shape
        x = copy_to_tp(x)
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        dropout_p = self.dropout_p if self.training else 0.0
        # Heads are sharded across TP ranks, so attention dropout draws from this rank's stream.
        with tp_rng(x.device) if dropout_p > 0 else contextlib.nullcontext():
            if self.backend == "sdpa":
                ctx = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=None if key_mask is None else key_mask[:, None, None, :],
                    dropout_p=dropout_p)
            else:
                scores = q @ k.transpose(-1, -2)  # B x h x S x S
                probs = fused_scale_mask_softmax(scores, key_mask, 1.0 / math.sqrt(self.head_dim))
                ctx = F.dropout(probs, dropout_p) @ v  # B x h x S x d
        ctx = ctx.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        return self.dense(ctx)


class FeedForward(nn.Module):
    """H -> F (column-parallel) -> exact GELU -> F -> H (row-parallel)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate = ColumnParallelLinear(config.hidden_size, config.intermediate_size)
        self.output = RowParallelLinear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(F.gelu(self.intermediate(copy_to_tp(x))))


class TransformerLayer(nn.Module):
    """x = LN(x + Attn(x)); x = LN(x + FFN(x)), with dropout on each residual branch."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention = SelfAttention(config)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.ffn = FeedForward(config)
        self.ffn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        # model.compile: the layer's computation through torch.compile. One graph per attention
        # path, shared by every layer (dynamo takes the parameters as inputs, and the TP
        # all-reduces and the RNG stream switch are opaque operators inside it); parameters,
        # names and checkpoints are the eager layer's. fallback_random: inductor draws dropout
        # masks with torch's generator and ops, in program order, so they equal eager's.
        # Wrapped at the first forward on a device that compiles: torch.compile imports dynamo
        # and inductor (seconds), which an eager run (CPU under auto) never needs.
        self._compiled = None
        self._compiles_on = config.compiles_on

    def _layer(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention_norm(x + self.dropout(self.attention(x, key_mask)))
        return self.ffn_norm(x + self.dropout(self.ffn(x)))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """x: B x S x H; key_mask: B x S bool or None (see SelfAttention) -> B x S x H."""
        if not self._compiles_on(x.device.type):
            return self._layer(x, key_mask)
        if self._compiled is None:
            self._compiled = torch.compile(self._layer, options={"fallback_random": True})
        if self.training and self.attention.dropout_p > 0:
            ensure_tp_stream(x.device)  # the graph switches to the TP stream, cannot seed it
        return self._compiled(x, key_mask)
