"""Exact parameter counts of the model and its parts, by the conventions of the paper
(built on the meta device); per pipeline layer and FLOPs: model/cost.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from megatron_rembert.config import ModelConfig
from megatron_rembert.model.cost import flops_per_token, parameter_table

__all__ = ["ParameterCounts", "count_parameters", "flops_per_token", "parameter_counts"]


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
    """The counts of `config`; pre-training and the embeddings from the cost model's parameter
    table (model/cost.py), the pooler from the encoder built with it."""
    from megatron_rembert.model.rembert import RemBertModel

    with torch.device("meta"):
        encoder = RemBertModel(config, add_pooler=True)
    table = {p.name: p.full for p in parameter_table(config)}
    pooler = count_parameters(encoder.pooler)
    pt = sum(table.values())
    ft_pooler = count_parameters(encoder)
    return ParameterCounts(
        pretraining=pt, pretraining_with_pooler=pt + pooler, finetuning=ft_pooler - pooler,
        finetuning_with_pooler=ft_pooler,
        input_embedding=count_parameters(encoder.embeddings.word_embeddings),
        # 0 for the weight when tied: the decoder's weight is then the input table
        output_embedding=table["mlm_head.decoder.bias"]
        + table.get("mlm_head.decoder.weight", 0))
