"""Sentence embeddings from the encoder's hidden states and their nearest-neighbour accuracy,
as XTREME's Tatoeba and BUCC tasks: mean-pooled hidden states of one layer (by default the
middle one, `middle_layer`), cosine similarity, accuracy@1 in both directions.

Pure tensor math on one process, below both callers: the trainer's periodic retrieval
(training/retrieval.py) and the offline evaluation (eval/), which produce the hidden states.
Layer numbers are those of transformers' `hidden_states`: 0 = the embedding output, i = the
output of Transformer layer i.
"""

from __future__ import annotations

import torch


def middle_layer(num_layers: int) -> int:
    """The layer pooled by default: (num_layers + 1) // 2, the middle Transformer layer (for
    an odd count exactly; for an even count the lower of the two central layers, which is the
    exact middle of the num_layers + 1 hidden states, embeddings included). Never 0 (the
    embeddings) for a model with layers: 1 of 1, 1 of 2, 2 of 3, 16 of 32 (RemBERT)."""
    if num_layers < 1:
        raise ValueError(f"middle_layer needs at least one layer, got {num_layers}")
    return (num_layers + 1) // 2


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """hidden: B x S x H; attention_mask: B x S (1 = real token). Returns B x H fp32: the mean
    of the real tokens' states (a row without real tokens gives zeros)."""
    mask = attention_mask.to(torch.float32).unsqueeze(-1)  # B x S x 1
    summed = (hidden.to(torch.float32) * mask).sum(dim=1)  # B x H
    return summed / mask.sum(dim=1).clamp(min=1.0)


def cosine_matrix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a: N x H, b: M x H. Returns N x M cosine similarities (fp32; a zero row scores 0)."""
    a = torch.nn.functional.normalize(a.to(torch.float32), dim=-1)
    b = torch.nn.functional.normalize(b.to(torch.float32), dim=-1)
    return a @ b.T


def accuracy_at_1(src: torch.Tensor, tgt: torch.Tensor) -> tuple[float, float]:
    """src, tgt: N x H embeddings of N aligned pairs (row i of src translates row i of tgt).

    Returns (src -> tgt, tgt -> src) accuracy@1: the share of rows whose nearest neighbour by
    cosine on the other side is its own translation. Ties go to the lowest index (argmax), so
    identical embeddings everywhere score 1/N at best, not 1."""
    if src.shape != tgt.shape or src.dim() != 2:
        raise ValueError(f"accuracy_at_1 needs two N x H tensors of one shape, got "
                         f"{tuple(src.shape)} and {tuple(tgt.shape)}")
    sim = cosine_matrix(src, tgt)  # N x N
    gold = torch.arange(sim.shape[0])
    forward = (sim.argmax(dim=1) == gold).float().mean().item()
    backward = (sim.argmax(dim=0) == gold).float().mean().item()
    return forward, backward


def center(x: torch.Tensor) -> torch.Tensor:
    """x: N x H embeddings of one language's texts. Returns them minus their mean (fp32).

    A multilingual encoder's sentence embeddings carry a direction shared by every text of a
    language (its identity, frequent tokens); subtracting each language's mean removes it
    before the cosine (Libovicky et al., 2020, "On the language neutrality of pre-trained
    multilingual representations"). XTREME's retrieval does not; `rembert-eval --center`."""
    x = x.to(torch.float32)
    return x - x.mean(dim=0, keepdim=True)


def chance(n_pairs: int) -> float:
    """Expected accuracy@1 of a random ranking of n_pairs candidates."""
    return 1.0 / n_pairs if n_pairs else 0.0
