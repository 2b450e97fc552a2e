"""Input embeddings at width E_in, then the projection to the Transformer's width H."""

from __future__ import annotations

import torch
from torch import nn

from megatron_rembert.config import ModelConfig
from megatron_rembert.parallel import state
from megatron_rembert.parallel.layers import VocabParallelEmbedding


class RemBertEmbeddings(nn.Module):
    """word (vocab-parallel) + position + token type at E_in, LayerNorm, dropout, Linear E_in -> H.

    The E_in -> H projection is `encoder.embedding_hidden_mapping_in` in transformers; it lives
    here so that the first pipeline stage owns every input-side weight.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        e_in = config.input_embedding_size
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size(state.tp_size()), e_in, config.vocab_size,
            padding_idx=config.pad_token_id)
        self.position_embeddings = _embedding(config.max_position_embeddings, e_in)
        self.token_type_embeddings = _embedding(config.type_vocab_size, e_in)
        self.layer_norm = nn.LayerNorm(e_in, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.projection = nn.Linear(e_in, config.hidden_size)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        """input_ids, token_type_ids: B x S int64 -> B x S x H."""
        seq_len = input_ids.shape[1]
        if seq_len > self.position_embeddings.num_embeddings:
            raise ValueError(
                f"sequence length {seq_len} exceeds model.max_position_embeddings="
                f"{self.position_embeddings.num_embeddings}")
        positions = torch.arange(seq_len, device=input_ids.device)  # S
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(token_type_ids))  # B x S x E_in
        x = self.dropout(self.layer_norm(x))
        return self.projection(x)  # B x S x H


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """nn.Embedding(rows, dim); built on the meta device (sizes, the memory estimate) without
    torch's random initialisation, which on meta tensors imports torch._dynamo (seconds of
    every start-up). The values do not matter there; init_weights sets every weight anyway."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding.from_pretrained(torch.empty(rows, dim), freeze=False)
    return nn.Embedding(rows, dim)
