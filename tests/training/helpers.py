"""Synthetic MLM samples as a pure function of (seed, global index), and layout runs."""

from __future__ import annotations

import torch

SEQ, PREDICTIONS = 16, 4


def sample(index: int, vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    length = int(torch.randint(8, SEQ + 1, (1,), generator=g))
    ids = torch.zeros(SEQ, dtype=torch.long)
    ids[:length] = torch.randint(5, vocab_size, (length,), generator=g)
    mask = torch.zeros(SEQ, dtype=torch.long)
    mask[:length] = 1
    n_pred = int(torch.randint(1, PREDICTIONS + 1, (1,), generator=g))
    positions = torch.zeros(PREDICTIONS, dtype=torch.long)
    positions[:n_pred] = torch.randperm(length, generator=g)[:n_pred]
    labels = torch.zeros(PREDICTIONS, dtype=torch.long)
    labels[:n_pred] = ids[positions[:n_pred]]
    weights = torch.zeros(PREDICTIONS)
    weights[:n_pred] = 1.0
    ids[positions[:n_pred]] = 4  # [MASK]
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids),
                masked_positions=positions, masked_labels=labels, masked_weights=weights)


def micro_batches(step: int, global_batch: int, micro: int, dp_rank: int, dp: int,
                  vocab_size: int) -> list[dict[str, torch.Tensor]]:
    """This DP rank's micro-batches of global batch `step` (a contiguous slice of it)."""
    per_rank = global_batch // dp
    start = step * global_batch + dp_rank * per_rank
    samples = [sample(start + i, vocab_size) for i in range(per_rank)]
    return [{k: torch.stack([s[k] for s in samples[i:i + micro]]) for k in samples[0]}
            for i in range(0, per_rank, micro)]
