"""Megatron-style tensor-parallel layers and layout-independent initialisation.

Every parameter made here carries two attributes:
- `tp_split_dim`: the dimension split across ranks (0 or 1), or None when replicated;
- `full_shape`: the shape of the whole (unsplit) tensor.
Vocabulary tables also carry `vocab_rows`: the real vocabulary size; rows past it are padding.
Checkpoint conversion, resharding and the TP tests rely only on these attributes.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron_rembert.kernels.embedding import embedding_into_main_grad
from megatron_rembert.parallel import state
from megatron_rembert.parallel.mappings import reduce_from_tp


def _split_param(full_shape: tuple[int, ...], split_dim: int | None) -> nn.Parameter:
    shape = list(full_shape)
    if split_dim is not None:
        tp = state.tp_size()
        if shape[split_dim] % tp:
            raise ValueError(f"dimension {split_dim} of {full_shape} is not divisible by tp={tp}")
        shape[split_dim] //= tp
    param = nn.Parameter(torch.empty(shape))
    param.tp_split_dim = split_dim
    param.full_shape = tuple(full_shape)
    # DeepSpeed's gradient-norm code counts parameters with this flag on every TP rank and
    # the others (replicated on the TP ranks) once.
    param.tensor_model_parallel = split_dim is not None
    return param


def is_tp_sharded(param: torch.Tensor) -> bool:
    """Split across the TP group (its norm sums over the TP ranks), not replicated."""
    return bool(getattr(param, "tensor_model_parallel", False))


def shard_of(full: torch.Tensor, split_dim: int | None, rank: int, size: int) -> torch.Tensor:
    """This rank's slice of a full tensor along `split_dim` (the whole tensor when None)."""
    if split_dim is None:
        return full
    return full.chunk(size, dim=split_dim)[rank]


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local^T + b_local: output features split across TP ranks.

    The input must already be the same on all TP ranks; the caller puts one `copy_to_tp` in
    front of a group of column-parallel layers (Q, K, V share one), so that backward
    all-reduces the input gradient once per block, not once per layer.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.weight = _split_param((out_features, in_features), 0)  # out/tp x in
        self.bias = _split_param((out_features,), 0) if bias else None  # out/tp

    # train.fp8: the layer's GEMM in fp8 (parallel/fp8.py, set by enable_fp8); None: F.linear.
    fp8_gemm = None

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """`add_bias=False` leaves the bias to the caller (a fused kernel adds it)."""
        bias = self.bias if add_bias else None
        if self.fp8_gemm is None:
            return F.linear(x, self.weight, bias)
        y = self.fp8_gemm(x, self.weight)  # ... x out/tp
        return y if bias is None else y + bias


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b: input features split across TP ranks.

    The one forward all-reduce of an attention or FFN block happens here; the bias is added
    after it (once, not tp times).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.weight = _split_param((out_features, in_features), 1)  # out x in/tp
        self.bias = _split_param((out_features,), None) if bias else None  # out

    fp8_gemm = None  # as ColumnParallelLinear's

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """`add_bias=False` leaves the bias to the caller (a fused kernel adds it)."""
        partial = (F.linear(x, self.weight) if self.fp8_gemm is None
                   else self.fp8_gemm(x, self.weight))  # ... x out, this rank's share
        y = reduce_from_tp(partial)
        return y if self.bias is None or not add_bias else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank looks up its own ids, then all-reduce.

    `num_embeddings` is the padded vocabulary (a multiple of 128 x tp); `vocab_size` the real one.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, vocab_size: int,
                 padding_idx: int | None = None):
        super().__init__()
        self.weight = _split_param((num_embeddings, embedding_dim), 0)  # V_pad/tp x E
        self.weight.vocab_rows = vocab_size
        self.weight.padding_idx = padding_idx
        self.vocab_start = state.tp_rank() * self.weight.shape[0]
        self.vocab_end = self.vocab_start + self.weight.shape[0]
        local_pad = None
        if padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end:
            local_pad = padding_idx - self.vocab_start
        self.local_padding_idx = local_pad

    def _lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Rows of this shard. Where the trainer's fp32 gradient buffer (parallel/grad_buffer.py)
        has the table summed by kernels (`main_grad_added`), backward adds each token's row
        into `weight.main_grad` (tokens x E work) instead of producing a dense V_local x E
        gradient, and reports it."""
        added = getattr(self.weight, "main_grad_added", None)
        if added is not None and torch.is_grad_enabled() and self.weight.requires_grad:
            return embedding_into_main_grad(local_ids, self.weight, self.weight.main_grad,
                                            self.local_padding_idx, added)
        return F.embedding(local_ids, self.weight, self.local_padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if state.tp_size() == 1:
            return self._lookup(ids)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = self._lookup(local_ids)  # ... x E; rows of other shards are zeroed below
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out)


class VocabParallelOutput(nn.Module):
    """The output embedding E_out -> V (with bias), split by vocabulary rows.

    Holds the weights only: the MLM loss multiplies masked hidden states by this rank's shard
    and combines the shards inside the vocab-parallel cross-entropy, never gathering logits.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, vocab_size: int):
        super().__init__()
        self.weight = _split_param((num_embeddings, embedding_dim), 0)  # V_pad/tp x E_out
        self.weight.vocab_rows = vocab_size
        self.bias = _split_param((num_embeddings,), 0)  # V_pad/tp
        self.bias.vocab_rows = vocab_size
        self.vocab_start = state.tp_rank() * self.weight.shape[0]
        # Columns of this shard holding real vocabulary; the rest are padding (never predicted).
        self.n_valid = max(0, min(vocab_size - self.vocab_start, self.weight.shape[0]))


def _param_seed(seed: int, name: str) -> int:
    # crc32 is stable across processes and Python versions (unlike hash()).
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_weights(module: nn.Module, seed: int, std: float, prefix: str = "") -> None:
    """Initialise every parameter independently of the parallel layout.

    Each parameter's full tensor is drawn from a generator seeded by (seed, its name), then
    this rank keeps its shard: TP=1 and TP=k built from one seed hold the same full weights.
    Rules (as BERT / RemBERT): LayerNorm weight 1; biases 0; other weights N(0, std); vocabulary
    padding rows and the padding token's embedding row 0.
    """
    seen: set[int] = set()
    for module_name, owner in module.named_modules():
        for leaf, param in owner.named_parameters(recurse=False):
            if id(param) in seen:  # a tied weight is initialised once, under its first name
                continue
            seen.add(id(param))
            full_name = prefix + (f"{module_name}.{leaf}" if module_name else leaf)
            full_shape = getattr(param, "full_shape", tuple(param.shape))
            if isinstance(owner, nn.LayerNorm):
                full = torch.ones(full_shape) if leaf == "weight" else torch.zeros(full_shape)
            elif leaf == "bias":
                full = torch.zeros(full_shape)
            else:
                gen = torch.Generator().manual_seed(_param_seed(seed, full_name))
                rows = getattr(param, "vocab_rows", full_shape[0])
                full = torch.zeros(full_shape)
                full[:rows].normal_(0.0, std, generator=gen)
                pad = getattr(param, "padding_idx", None)
                if pad is not None:
                    full[pad] = 0.0
            shard = shard_of(full, getattr(param, "tp_split_dim", None), state.tp_rank(),
                             state.tp_size())
            param.copy_(shard)
