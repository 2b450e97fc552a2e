"""Parameter specs: what a checkpoint stores of each parameter, at any TP size.

One full tensor per parameter, vocabulary padding stripped, is the common currency: saved TP
shards are merged into it (`merge_shards`) and a rank's shard is cut from it (`shard`).
Padding rows are zero-filled, which is exact: they have zero weight, gradient and Adam moments
in training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rembert.checkpoint import CheckpointError
from megatron_rembert.config import ModelConfig
from megatron_rembert.model.pipeline import pipeline_layer
from megatron_rembert.parallel import state


@dataclass(frozen=True)
class ParamSpec:
    name: str  # global name, e.g. rembert.layers.3.attention.query.weight
    split_dim: int | None  # dimension split across TP ranks, None when replicated
    padded_shape: tuple[int, ...]  # full shape at this TP size (vocabulary padded)
    shape: tuple[int, ...]  # full shape without vocabulary padding (what files store)
    layer: int  # pipeline layer: 0 embeddings, 1..L Transformer layers, L+1 MLM head

    @classmethod
    def of(cls, name: str, param: torch.Tensor, num_layers: int) -> ParamSpec:
        """The spec of a model parameter (its TP attributes give the full shape)."""
        padded = tuple(getattr(param, "full_shape", tuple(param.shape)))
        rows = getattr(param, "vocab_rows", None)
        shape = (rows, *padded[1:]) if rows is not None else padded
        return cls(name, getattr(param, "tp_split_dim", None), padded, shape,
                   layer_of(name, num_layers))

    def local_shape(self, tp: int) -> tuple[int, ...]:
        shape = list(self.padded_shape)
        if self.split_dim is not None:
            shape[self.split_dim] //= tp
        return tuple(shape)


def layer_of(name: str, num_layers: int) -> int:
    try:
        return pipeline_layer(name, num_layers)
    except ValueError as err:
        raise CheckpointError(str(err)) from err


def param_specs(config: ModelConfig, tp: int = 1) -> list[ParamSpec]:
    """Every trainable parameter of the pre-training model at TP size `tp` (meta device)."""
    from megatron_rembert.model.rembert import RemBertForPreTraining

    with state.offline(tp), torch.device("meta"):
        model = RemBertForPreTraining(config)
    return [ParamSpec.of(name, p, config.num_hidden_layers)
            for name, p in model.named_parameters()]


def no_weight_decay(name: str, ndim: int) -> bool:
    """BERT's convention: no weight decay on biases and LayerNorm parameters. The optimizer's
    two parameter groups (training/optim.py: decay, then no decay, each in the model's order)
    follow it."""
    return ndim == 1 or name.endswith(".bias")


def merge_shards(shards: list[torch.Tensor], spec: ParamSpec) -> torch.Tensor:
    """TP shards -> the full tensor, vocabulary padding stripped."""
    full = shards[0] if spec.split_dim is None else torch.cat(shards, dim=spec.split_dim)
    if tuple(full.shape) != spec.padded_shape:
        raise CheckpointError(f"{spec.name}: merged shape {tuple(full.shape)}, expected "
                              f"{spec.padded_shape}")
    return full[: spec.shape[0]] if spec.shape != spec.padded_shape else full


def shard(full, spec: ParamSpec, tp: int, tp_rank: int) -> torch.Tensor:
    """TP rank `tp_rank`'s shard of a stored full tensor (vocabulary stripped), padding rows
    zero-filled. `full`: a tensor, or anything sliced like one (safetensors' `get_slice`)."""
    padded, rows = spec.padded_shape, spec.shape[0]
    if spec.split_dim == 1:
        n = padded[1] // tp
        return full[:, tp_rank * n:(tp_rank + 1) * n]
    start, n = (tp_rank * (padded[0] // tp), padded[0] // tp) if spec.split_dim == 0 else (0, rows)
    out = torch.zeros((n, *padded[1:]))
    real_end = min(start + n, rows)
    if real_end > start:
        out[: real_end - start] = full[start:real_end]
    if spec.split_dim is None and rows < padded[0]:
        out = torch.cat([out, torch.zeros((padded[0] - rows, *padded[1:]))])
    return out
