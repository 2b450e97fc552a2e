"""Exact parameter counts (built on the meta device) and model FLOPs per token."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from megatron_rembert.config import ModelConfig
from megatron_rembert.data.config import DataConfig


def count_parameters(what: nn.Module | nn.Parameter) -> int:
    """Unique parameters of the full (unsharded) model, vocabulary padding excluded."""
    total = 0
    seen: set[int] = set()
    for param in [what] if isinstance(what, nn.Parameter) else what.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        shape = getattr(param, "full_shape", tuple(param.shape))
        rows = getattr(param, "vocab_rows", shape[0])
        total += rows * math.prod(shape[1:])
    return total


@dataclass
class ParameterCounts:
    pretraining: int  # encoder + MLM head (what trains), no pooler
    pretraining_with_pooler: int  # the paper's pre-training count convention
    finetuning: int  # encoder body without pooler: the paper's fine-tuning count
    finetuning_with_pooler: int
    input_embedding: int  # word embedding table |V| x E_in
    output_embedding: int  # |V| x E_out + bias (0 when tied: it is the input table)


def parameter_counts(config: ModelConfig) -> ParameterCounts:
    from megatron_rembert.model.rembert import RemBertForPreTraining, RemBertModel

    with torch.device("meta"):
        pretraining = RemBertForPreTraining(config)
        encoder = RemBertModel(config, add_pooler=True)
    pooler = count_parameters(encoder.pooler)
    decoder = pretraining.mlm_head.decoder
    output = count_parameters(decoder.bias)
    if not config.tie_embeddings:
        output += count_parameters(decoder.weight)
    pt = count_parameters(pretraining)
    ft_pooler = count_parameters(encoder)
    return ParameterCounts(
        pretraining=pt, pretraining_with_pooler=pt + pooler, finetuning=ft_pooler - pooler,
        finetuning_with_pooler=ft_pooler,
        input_embedding=count_parameters(encoder.embeddings.word_embeddings),
        output_embedding=output)


def flops_per_token(config: ModelConfig, seq_length: int,
                    mask_rate: float = DataConfig.mask_prob) -> dict:
    """Matmul FLOPs per input token (2 per multiply-add), forward and training (3x forward).

    Bidirectional attention: every query attends to all seq_length keys (no causal halving).
    The MLM head (dense, output projection) runs only at masked positions: counted x mask_rate.
    Embedding lookups, norms and softmax are not matmuls and are left out, as in the usual MFU
    accounting (Chowdhery et al., 2022, PaLM, Appendix B).
    """
    h, f, s = config.hidden_size, config.intermediate_size, seq_length
    e_in, e_out, v = config.input_embedding_size, config.output_embedding_size, config.vocab_size
    per_layer = 2 * (4 * h * h + 2 * h * f) + 2 * 2 * s * h  # QKVO + FFN + (QK^T, PV)
    body = 2 * e_in * h + config.num_hidden_layers * per_layer
    head = mask_rate * 2 * (h * e_out + e_out * v)
    forward = body + head
    return {"forward": forward, "training": 3 * forward, "head_share": head / forward}
