"""The bag-of-tokens baseline: what the tokenizer's ids alone give, with no model.

- Retrieval: each text is the vector of its token counts (the tokenizer's piece ids, as the
  model reads them: cut to max_length - 2, without [CLS] and [SEP]); pairs are matched by the
  cosine of these vectors. With `tfidf`, each count is multiplied by the piece's inverse
  document frequency over the language's set (both sides, 2N texts), idf = ln((1 + 2N) /
  (1 + df)) + 1. Shared pieces (numbers, names, code, punctuation, untranslated words) are what
  this baseline finds; a model must beat it to show it learned more than string overlap.
- Classification: multinomial logistic regression on token counts, trained on the train
  language only (full batch, L-BFGS, float64, mean cross-entropy + L2_WEIGHT/2 * |W|^2, the
  bias not penalised; convex, so one deterministic solution and no seeds).
"""

from __future__ import annotations

import math

import torch

from megatron_rembert.model.retrieval import accuracy_at_1, center

L2_WEIGHT = 1e-3
WEIGHTINGS = ("counts", "tfidf")


def count_vectors(docs: list[list[int]], columns: dict[int, int] | None = None,
                  dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, dict[int, int]]:
    """docs: token ids per text -> (N x U counts, {token id: column}). The columns are the ids
    that occur (`columns` extends a given map): a 250k vocabulary never becomes a dense
    N x 250k matrix."""
    columns = dict(columns or {})
    for doc in docs:
        for token in doc:
            columns.setdefault(token, len(columns))
    out = torch.zeros(len(docs), max(len(columns), 1), dtype=dtype)
    for row, doc in enumerate(docs):
        for token in doc:
            if token in columns:
                out[row, columns[token]] += 1.0
    return out, columns


def idf(counts: torch.Tensor) -> torch.Tensor:
    """Smoothed inverse document frequency of each column of an N x U count matrix."""
    n = counts.shape[0]
    df = (counts > 0).sum(dim=0).to(torch.float64)
    return (torch.log((1.0 + n) / (1.0 + df)) + 1.0).to(counts.dtype)


def bag_retrieval(texts: list[list[int]], english: list[list[int]], weighting: str,
                  centered: bool = False) -> tuple[float, float]:
    """(lang -> en, en -> lang) accuracy@1 of the count (or tf-idf) vectors' cosine; with
    `centered`, each side's vectors minus their mean first (as --center does to the models')."""
    # float32: counts are exact in it, and the cosine is computed in it anyway (2N x U).
    counts, _ = count_vectors(texts + english, dtype=torch.float32)
    if weighting == "tfidf":
        counts = counts * idf(counts)
    n = len(texts)
    if centered:
        return accuracy_at_1(center(counts[:n]), center(counts[n:]))
    return accuracy_at_1(counts[:n], counts[n:])


def fit_logistic(features: torch.Tensor, labels: list[int], num_labels: int,
                 l2: float = L2_WEIGHT) -> tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression: argmin over (W: K x U, b: K) of
    mean_i CE(W x_i + b, y_i) + l2/2 |W|^2, by L-BFGS from zeros. features: N x U."""
    x = features.to(torch.float64)
    y = torch.tensor(labels, dtype=torch.long)
    w = torch.zeros(num_labels, x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(num_labels, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=1000, tolerance_grad=1e-10,
                            tolerance_change=1e-14, history_size=20,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = objective(x, y, w, b, l2)
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def objective(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
              l2: float) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(x @ w.T + b, y) + 0.5 * l2 * (w * w).sum()


def bag_classification(train: list[list[int]], train_labels: list[int], num_labels: int,
                       tests: dict[str, list[list[int]]]) -> dict[str, torch.Tensor]:
    """{lang: predicted label indices} of the logistic regression trained on `train`. Tokens
    never seen in training carry no weight, so they are left out of the features."""
    x, columns = count_vectors(train)
    w, b = fit_logistic(x, train_labels, num_labels)
    out = {}
    for lang, docs in tests.items():
        rows = torch.zeros(len(docs), x.shape[1], dtype=torch.float64)
        for i, doc in enumerate(docs):
            for token in doc:
                if token in columns:
                    rows[i, columns[token]] += 1.0
        out[lang] = (rows @ w.T + b).argmax(dim=1)
    return out


def majority_rate(labels: list[int]) -> float:
    """The share of the most frequent label: what always answering it scores."""
    if not labels:
        return 0.0
    return max(labels.count(k) for k in set(labels)) / len(labels)


def uniform_rate(num_labels: int) -> float:
    return 1.0 / num_labels if num_labels else math.nan
