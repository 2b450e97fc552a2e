"""The model as a flat list of pipeline layers: embeddings, N Transformer layers, MLM head.

Each pipeline layer subclasses the module it wraps, keeping its parameter names, and knows its
global name prefix (`PIPE_PREFIX`), so layout-independent initialisation and checkpoint
conversion see the same names as in the plain model. Activations between stages are the tuple
(hidden B x S x H, attention_mask B x S, masked_positions B x P); the head's loss needs the
labels, which the pipeline engine gives to the loss function on the last stage.
"""

from __future__ import annotations

import torch

from megatron_rembert.config import ModelConfig
from megatron_rembert.model.embeddings import RemBertEmbeddings
from megatron_rembert.model.mlm_head import MLMHead, MLMLoss, gather_positions
from megatron_rembert.model.transformer import TransformerLayer


class EmbeddingPipe(RemBertEmbeddings):
    pipe_prefix = "rembert.embeddings."

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        input_ids, attention_mask, token_type_ids, masked_positions = inputs
        return super().forward(input_ids, token_type_ids), attention_mask, masked_positions


class TransformerLayerPipe(TransformerLayer):
    def __init__(self, config: ModelConfig, index: int):
        super().__init__(config)
        self.pipe_prefix = f"rembert.layers.{index}."

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, attention_mask, masked_positions = inputs
        return super().forward(hidden, attention_mask.bool()), attention_mask, masked_positions


class MLMHeadPipe(MLMHead):
    """Gathers the masked positions; the loss runs in `loss`, called with the labels."""

    pipe_prefix = "mlm_head."

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        hidden, _attention_mask, masked_positions = inputs
        return gather_positions(hidden, masked_positions)  # (B*P) x H

    def loss(self, masked_hidden: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]
             ) -> MLMLoss:
        masked_labels, masked_weights = labels
        return MLMHead.forward(self, masked_hidden, masked_labels.reshape(-1),
                               masked_weights.reshape(-1))


def pipeline_layer_builders(config: ModelConfig) -> list[tuple[type, tuple]]:
    """(class, args) for every pipeline layer, in order: build only the ones a stage owns."""
    return ([(EmbeddingPipe, (config,))]
            + [(TransformerLayerPipe, (config, i)) for i in range(config.num_hidden_layers)]
            + [(MLMHeadPipe, (config,))])


def pipeline_layer_costs(config: ModelConfig) -> list[int]:
    """Parameters per pipeline layer (what a stage must hold, with optimizer states): the
    418M-parameter RemBERT head counts for ~26 Transformer layers."""
    h, f = config.hidden_size, config.intermediate_size
    e_in, e_out, v = config.input_embedding_size, config.output_embedding_size, config.vocab_size
    embedding = ((v + config.max_position_embeddings + config.type_vocab_size) * e_in + 2 * e_in
                 + e_in * h + h)
    layer = 4 * h * h + 2 * h * f + 9 * h + f
    head = h * e_out + 3 * e_out + v * (0 if config.tie_embeddings else e_out) + v
    return [embedding] + [layer] * config.num_hidden_layers + [head]
