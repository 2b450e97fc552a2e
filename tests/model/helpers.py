"""Small configs and random MLM batches shared by the model and parallel tests."""

from __future__ import annotations

import torch

from megatron_rembert.config import ModelConfig


def small_config(**changes) -> ModelConfig:
    """3 layers, 6 heads, FFN 96: divisible by tp = 2 and 3; vocab 300 is not a multiple of 128,
    so every layout has padding rows."""
    base = ModelConfig(vocab_size=300, hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
                       intermediate_size=96, input_embedding_size=16, output_embedding_size=40,
                       max_position_embeddings=64)
    return base.replace(**changes)


def random_batch(config: ModelConfig, batch: int = 3, seq: int = 20, predictions: int = 5,
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch as the data pipeline produces it: padding at the end of row 0, the last
    prediction slot of row 1 unused (weight 0)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, config.vocab_size, (batch, seq), generator=g)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[0, seq - 6:] = 0
    input_ids[0, seq - 6:] = config.pad_token_id
    token_type_ids = torch.randint(0, 2, (batch, seq), generator=g)
    positions = torch.stack([torch.randperm(seq - 6, generator=g)[:predictions]
                             for _ in range(batch)])
    labels = torch.randint(0, config.vocab_size, (batch, predictions), generator=g)
    weights = torch.ones(batch, predictions)
    weights[1, -1] = 0.0
    labels[1, -1] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                masked_positions=positions, masked_labels=labels, masked_weights=weights,
                unpadded=torch.zeros(1, dtype=torch.long))
