"""The cost model: parameters, matmul FLOPs and tensor-parallel all-reduces of every pipeline
layer (embedding, N Transformer layers, MLM head), the one place they are derived.

Parameters come from the model itself, built on the meta device (`parameter_table`): what a
checkpoint stores (`full`, vocabulary padding excluded) and what one TP rank holds (`local`).
FLOPs (2 per multiply-add) come from the matmul shapes (`LayerFlops`); the MLM head's depend on
how many rows it runs on, so every FLOP count takes the masked tokens (or the mask rate) of the
step it is for. Consumers: the stage split and the memory estimate (training/estimate.py), the
logged MFU (training/loop.py, with each step's real masked tokens), `--dry-run` (with the data
plan's mask-rate schedule) and the summary CLI. The TP all-reduces (`tp_all_reduces`) feed
the communication estimate of `--dry-run` (training/communication.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_rembert.config import ModelConfig
from megatron_rembert.data.config import DataConfig


# -- parameters -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParameterShape:
    name: str  # global name, e.g. rembert.layers.3.attention.query.weight
    layer: int  # pipeline layer: 0 embedding, 1..N Transformer layers, N + 1 MLM head
    full: int  # elements of the whole tensor, vocabulary padding excluded (what files store)
    local: int  # elements one TP rank holds (its shard, vocabulary padding included)


def parameter_table(config: ModelConfig, tp: int = 1) -> list[ParameterShape]:
    """Every trainable parameter of the pre-training model at TP size `tp`, built on the meta
    device (allocates nothing; the 995M model takes ~50 ms). A tied output embedding is the
    input table and counted once, on the embedding."""
    from megatron_rembert.model.pipeline import pipeline_layer
    from megatron_rembert.model.rembert import RemBertForPreTraining
    from megatron_rembert.parallel import state

    with state.offline(tp), torch.device("meta"):
        model = RemBertForPreTraining(config)
    table = []
    for name, param in model.named_parameters():  # each shared parameter once
        shape = tuple(getattr(param, "full_shape", tuple(param.shape)))
        rows = getattr(param, "vocab_rows", shape[0])
        table.append(ParameterShape(name, pipeline_layer(name, config.num_hidden_layers),
                                    rows * math.prod(shape[1:]), param.numel()))
    return table


def layer_parameters(config: ModelConfig, tp: int = 1, local: bool = False) -> list[int]:
    """Parameters per pipeline layer: the whole model's (`local=False`), or one TP rank's
    shard (`local=True`, vocabulary padding included: what the rank holds)."""
    per_layer = [0] * (config.num_hidden_layers + 2)
    for p in parameter_table(config, tp):
        per_layer[p.layer] += p.local if local else p.full
    return per_layer


# -- FLOPs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerFlops:
    """Forward matmul FLOPs of one sequence of `seq_length` tokens per pipeline layer, and of
    the MLM head per row it runs on. Bidirectional attention: every query attends to all
    seq_length keys (no causal halving). Embedding lookups, norms and softmax are not matmuls
    and are left out, as in the usual MFU accounting (Chowdhery et al., 2022, PaLM, App. B)."""

    embedding: float  # the E_in -> H projection, per sequence
    layer: float  # one Transformer layer per sequence: Q, K, V, O, the FFN, QK^T and PV
    head_dense: float  # per head row: H -> E_out
    head_projection: float  # per head row: E_out -> V (the output projection)

    @classmethod
    def of(cls, config: ModelConfig, seq_length: int) -> LayerFlops:
        h, f, s = config.hidden_size, config.intermediate_size, seq_length
        e_in, e_out, v = (config.input_embedding_size, config.output_embedding_size,
                          config.vocab_size)
        return cls(embedding=2.0 * s * e_in * h,
                   layer=s * (2.0 * (4 * h * h + 2 * h * f) + 2 * 2 * s * h),
                   head_dense=2.0 * h * e_out, head_projection=2.0 * e_out * v)

    def body(self, num_layers: int) -> float:
        """Forward FLOPs of one sequence before the head."""
        return self.embedding + num_layers * self.layer


def model_flops(config: ModelConfig, seq_length: int, sequences: int,
                masked_tokens: float) -> dict[str, float]:
    """Model FLOPs (the MFU count) of `sequences` sequences holding `masked_tokens` real masked
    tokens: forward, and training = 3 x forward (backward is twice the forward; activation
    recomputation is not model work). The MLM head counts the masked tokens only: its padded
    slots and the unmasked positions do no useful work."""
    cost = LayerFlops.of(config, seq_length)
    body = sequences * cost.body(config.num_hidden_layers)
    head = masked_tokens * (cost.head_dense + cost.head_projection)
    forward = body + head
    return {"forward": forward, "training": 3 * forward, "head_share": head / forward}


def flops_per_token(config: ModelConfig, seq_length: int,
                    mask_rate: float = DataConfig.mask_prob) -> dict[str, float]:
    """`model_flops` per input token, where a fraction `mask_rate` of the tokens is masked."""
    per_sequence = model_flops(config, seq_length, 1, mask_rate * seq_length)
    return {k: v / seq_length if k != "head_share" else v for k, v in per_sequence.items()}


def pipeline_layer_flops(config: ModelConfig, seq_length: int, predictions: int,
                         recompute: bool, *, masked: float | None = None) -> list[float]:
    """Training matmul FLOPs per sequence of every pipeline layer as the hardware runs them
    (what the stage split balances), 2 per multiply-add.

    Training is forward + backward (2x forward), plus one more forward of each Transformer
    layer with activation checkpointing (`recompute`). The head's dense (H -> E_out) runs on
    the `predictions` slots of a sequence (P, padded slots included: its GEMM is B*P rows).
    The output projection (E_out -> V, most of the head) runs on as many rows with
    model.loss_backend=reference, which computes the logits of every slot; the fused loss
    (kernels/cross_entropy.py) skips the slots of weight 0, so it runs on the `masked` real
    tokens of a sequence (default: all P), and recomputes their logits tile by tile in
    backward: one more forward of the projection.
    """
    cost = LayerFlops.of(config, seq_length)
    fused = config.loss_backend == "fused"
    rows = predictions if masked is None or not fused else masked
    projection = rows * cost.head_projection  # forward of the output projection
    head = 3 * (predictions * cost.head_dense + projection) + (projection if fused else 0)
    layer = (4 if recompute else 3) * cost.layer
    return [3 * cost.embedding] + [layer] * config.num_hidden_layers + [float(head)]


# -- tensor-parallel all-reduces --------------------------------------------------------------
@dataclass(frozen=True)
class TPAllReduce:
    """One kind of all-reduce over the TP group that a pipeline layer runs per micro-batch, as
    the code issues it (parallel/mappings.py; `tag` is the tag it counts under there)."""

    tag: str  # "forward" (reduce_from_tp), "backward" (copy_to_tp's gradient), "loss"
    what: str  # the tensor, in words
    elements: int  # of one call's buffer
    element_bytes: int
    calls: int  # per micro-batch

    @property
    def buffer_bytes(self) -> int:
        return self.elements * self.element_bytes


def tp_all_reduces(config: ModelConfig, seq_length: int, predictions: int, micro_batch: int,
                   recompute: bool, activation_bytes: int) -> list[list[TPAllReduce]]:
    """Per pipeline layer, the TP all-reduces of one micro-batch of `micro_batch` sequences
    (at tp > 1; none at tp = 1), activations of `activation_bytes` per element:
    - embedding: the vocab-parallel lookup's partial rows summed, B x S x E_in (forward);
    - Transformer layer: the attention and FFN output projections (row-parallel) in forward,
      the gradient of each block's input (`copy_to_tp`) in backward, B x S x H each; with
      activation checkpointing the forward runs again in backward, its all-reduces too;
    - MLM head: the gradient of the transformed rows (`copy_to_tp`), B*P x E_out, and the
      vocab-parallel loss's row max (MAX) and [sum-exp, target logit] (SUM) of B*P rows, fp32
      (both loss backends; parallel/cross_entropy.py).
    Sequence parallelism does not exist here: every TP collective is an all-reduce."""
    b, s, h = micro_batch, seq_length, config.hidden_size
    rows = b * predictions  # the head runs on every slot, padded ones included (static shapes)
    embedding = [TPAllReduce("forward", "embedding lookup", b * s * config.input_embedding_size,
                             activation_bytes, 1)]
    layer = [TPAllReduce("forward", "attention and FFN outputs", b * s * h, activation_bytes,
                         4 if recompute else 2),
             TPAllReduce("backward", "attention and FFN input gradients", b * s * h,
                         activation_bytes, 2)]
    head = [TPAllReduce("backward", "MLM head input gradient",
                        rows * config.output_embedding_size, activation_bytes, 1),
            TPAllReduce("loss", "loss row max", rows, 4, 1),
            TPAllReduce("loss", "loss sum-exp and target logit", 2 * rows, 4, 1)]
    return [embedding] + [layer] * config.num_hidden_layers + [head]
