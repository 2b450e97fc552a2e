"""Zero-shot cross-lingual classification, as XTREME's XNLI/PAWS-X protocol: fine-tune the
encoder and a linear classifier on one language (English) only, then measure accuracy on
every language of the test set.

The classifier reads the mean over real tokens of the last layer's hidden states (not the
[CLS] state: our pre-training has no next-sentence task that would train [CLS] alone).
Training: AdamW (weight decay 0.01, none on biases and LayerNorms), the learning rate warmed
up linearly over the first 10% of steps then decayed linearly to 0, gradients clipped at 1.0,
cross-entropy; the encoder's own dropout settings. Each seed draws the classifier's initial
weights, the example order and dropout; every seed starts from the same encoder weights.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from megatron_rembert.eval.embed import length_batches, pad
from megatron_rembert.model.rembert import RemBertModel
from megatron_rembert.model.retrieval import mean_pool

POOLING = "mean of the last layer over real tokens"
WARMUP, WEIGHT_DECAY, CLIP = 0.1, 0.01, 1.0


class Classifier(nn.Module):
    def __init__(self, encoder: RemBertModel, num_labels: int, generator: torch.Generator):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, num_labels)
        with torch.no_grad():
            self.head.weight.normal_(0.0, encoder.config.initializer_range, generator=generator)
            self.head.bias.zero_()

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, mask: B x S -> logits B x K."""
        return self.head(mean_pool(self.encoder(ids, mask), mask))


def head_parameters(hidden_size: int, num_labels: int) -> int:
    return hidden_size * num_labels + num_labels


def train_steps(n: int, epochs: int, batch_size: int) -> int:
    return epochs * -(-n // batch_size)


def finetune(encoder: RemBertModel, seqs: list[list[int]], labels: list[int], num_labels: int,
             seed: int, epochs: int, lr: float, batch_size: int, device: torch.device | str,
             pad_id: int, on_step: Callable[[], None] = lambda: None) -> Classifier:
    """A copy of `encoder` with a fresh linear head, fine-tuned on (seqs, labels)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout, if the model has any
    model = Classifier(copy.deepcopy(encoder), num_labels, gen).to(device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": rest, "weight_decay": 0.0}], lr=lr)
    total = train_steps(len(seqs), epochs, batch_size)
    warmup = max(1, int(WARMUP * total))

    def rate(step: int) -> float:  # linear warmup, then linear decay to 0
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)
    target = torch.tensor(labels, dtype=torch.long)
    for _ in range(epochs):
        order = torch.randperm(len(seqs), generator=gen).tolist()
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            ids, mask = pad([seqs[i] for i in batch], pad_id, device)
            loss = nn.functional.cross_entropy(model(ids, mask), target[batch].to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            sched.step()
            on_step()
    return model.eval()


@torch.no_grad()
def predict(model: Classifier, seqs: list[list[int]], batch_size: int,
            device: torch.device | str, pad_id: int) -> torch.Tensor:
    """Predicted label index of every sequence, in input order (N, int64)."""
    model.eval()
    out = torch.zeros(len(seqs), dtype=torch.long)
    for batch in length_batches(seqs, batch_size):
        ids, mask = pad([seqs[i] for i in batch], pad_id, device)
        out[torch.tensor(batch)] = model(ids, mask).argmax(dim=-1).cpu()
    return out


def accuracy(predicted: torch.Tensor, labels: list[int]) -> float:
    return (predicted == torch.tensor(labels, dtype=torch.long)).float().mean().item()


def balanced_accuracy(predicted: torch.Tensor, labels: list[int]) -> float:
    """The mean over the labels present in `labels` of the share of their examples predicted
    right (macro-averaged recall). Unlike accuracy, answering one label always scores 1/K here
    whatever the labels' shares, so a test set whose labels are unequally frequent (the help
    modules are) cannot make a classifier that ignores its input look good."""
    target = torch.tensor(labels, dtype=torch.long)
    right = predicted == target
    return torch.stack([right[target == k].float().mean()
                        for k in target.unique()]).mean().item()
