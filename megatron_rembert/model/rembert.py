"""RemBERT: decoupled input (E_in) and output (E_out) embeddings around a post-LN encoder.

`RemBertModel` is the encoder (the fine-tuning model, optional pooler); `RemBertForPreTraining`
adds the MLM head. Parameter names mirror transformers' (`rembert.*`), the mapping to its state
dict is in megatron_rembert.convert.hf.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_rembert.config import ModelConfig, check_buildable
from megatron_rembert.model.embeddings import RemBertEmbeddings
from megatron_rembert.model.mlm_head import MLMHead, MLMLoss, gather_positions
from megatron_rembert.model.transformer import TransformerLayer
from megatron_rembert.parallel import state
from megatron_rembert.parallel.layers import init_weights
from megatron_rembert.parallel.random import checkpoint_safe


class Pooler(nn.Module):
    """Fine-tuning only: tanh(Linear(H, H)) of the first token."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class RemBertModel(nn.Module):
    def __init__(self, config: ModelConfig, add_pooler: bool = False):
        super().__init__()
        check_buildable(config, state.tp_size(), 1)
        self.config = config
        self.embeddings = RemBertEmbeddings(config)
        self.layers = nn.ModuleList(TransformerLayer(config)
                                    for _ in range(config.num_hidden_layers))
        self.pooler = Pooler(config) if add_pooler else None
        # Recompute each layer in backward instead of storing its activations.
        self.activation_checkpointing = False

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, output_hidden_states: bool = False,
                unpadded: torch.Tensor | bool = False):
        """input_ids, attention_mask (1 = real token), token_type_ids: B x S. `unpadded`
        (the batch key; the trainer passes it as a Python bool, a tensor is read here) says
        that attention_mask is all ones; attention then runs without a mask, as it does when
        attention_mask is None.

        Returns the last hidden state B x S x H, or with output_hidden_states the list of the
        hidden states after the embeddings and after every layer (as transformers does).
        """
        no_mask = attention_mask is None or bool(unpadded)
        key_mask = None if no_mask else attention_mask.bool()  # B x S
        x = self.embeddings(input_ids, token_type_ids)
        states = [x]
        for layer in self.layers:
            if self.activation_checkpointing and self.training:
                x = checkpoint(checkpoint_safe(layer), x, key_mask, use_reentrant=False)
            else:
                x = layer(x, key_mask)
            states.append(x)
        return states if output_hidden_states else x


class RemBertForPreTraining(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.rembert = RemBertModel(config)
        tied = self.rembert.embeddings.word_embeddings if config.tie_embeddings else None
        self.mlm_head = MLMHead(config, tied_embedding=tied)

    def init_weights(self, seed: int) -> None:
        """Layout-independent initialisation (see parallel.layers.init_weights)."""
        init_weights(self, seed, self.config.initializer_range)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor, masked_positions: torch.Tensor,
                masked_labels: torch.Tensor, masked_weights: torch.Tensor,
                unpadded: torch.Tensor | bool = False) -> MLMLoss:
        """All inputs B x S or B x P (the fixed width of masked predictions per sequence);
        `unpadded` as in RemBertModel.forward."""
        hidden = self.rembert(input_ids, attention_mask, token_type_ids,
                              unpadded=unpadded)  # B x S x H
        masked_hidden = gather_positions(hidden, masked_positions)  # (B*P) x H
        return self.mlm_head(masked_hidden, masked_labels.reshape(-1),
                             masked_weights.reshape(-1))
