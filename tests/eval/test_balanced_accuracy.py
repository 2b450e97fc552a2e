"""Balanced accuracy against a count written out by hand, and its chance level."""

import random

import torch

from megatron_rembert.eval.classify import accuracy, balanced_accuracy


def _by_hand(predicted: list[int], labels: list[int]) -> float:
    recalls = []
    for k in sorted(set(labels)):
        rows = [i for i, y in enumerate(labels) if y == k]
        recalls.append(sum(predicted[i] == k for i in rows) / len(rows))
    return sum(recalls) / len(recalls)


def test_equals_the_mean_recall_counted_by_hand():
    rng = random.Random(0)
    for _ in range(20):
        labels = [rng.choice([0, 0, 0, 1, 2, 4]) for _ in range(rng.randint(5, 40))]
        predicted = [rng.randrange(5) for _ in labels]
        got = balanced_accuracy(torch.tensor(predicted), labels)
        assert abs(got - _by_hand(predicted, labels)) < 1e-6


def test_answering_the_frequent_label_scores_one_over_k_not_its_share():
    labels = [0] * 90 + [1] * 7 + [2] * 3
    always_zero = torch.zeros(100, dtype=torch.long)
    assert abs(accuracy(always_zero, labels) - 0.9) < 1e-6
    assert abs(balanced_accuracy(always_zero, labels) - 1 / 3) < 1e-6
    assert balanced_accuracy(torch.tensor(labels), labels) == 1.0
