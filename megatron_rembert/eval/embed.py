"""Sentence embeddings: token ids -> mean-pooled hidden states of chosen layers, batch-wise.

Sequences are sorted by length and batched, so a batch pads little; the result comes back in
the input order. Layer 0 is the embedding output (after the E_in -> H projection), layer i the
output of Transformer layer i, as transformers' `hidden_states`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_rembert.model.rembert import RemBertModel
from megatron_rembert.model.retrieval import mean_pool


def length_batches(seqs: list[list[int]], batch_size: int) -> list[list[int]]:
    """Indices of `seqs` in batches of at most `batch_size`, shortest first (a stable sort:
    equal lengths keep their order)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def pad(seqs: list[list[int]], pad_id: int, device: torch.device | str
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> input_ids, attention_mask: B x S (S the longest sequence), int64."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, :len(seq)] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def embed(model: RemBertModel, seqs: list[list[int]], layers: list[int], batch_size: int,
          device: torch.device | str, pad_id: int,
          on_batch: Callable[[], None] = lambda: None) -> dict[int, torch.Tensor]:
    """{layer: N x H fp32 on the CPU}: the mean over each sequence's real tokens ([CLS] and
    [SEP] included, padding not) of that layer's hidden states. `on_batch` is called after
    each batch (progress)."""
    model.eval()
    out = {layer: torch.zeros(len(seqs), model.config.hidden_size) for layer in layers}
    for batch in length_batches(seqs, batch_size):
        ids, mask = pad([seqs[i] for i in batch], pad_id, device)
        states = model(ids, mask, output_hidden_states=True)  # L+1 tensors B x S x H
        rows = torch.tensor(batch)
        for layer in layers:
            out[layer][rows] = mean_pool(states[layer], mask).cpu()
        on_batch()
    return out


def n_batches(n: int, batch_size: int) -> int:
    return -(-n // batch_size)
