"""Zero-shot classification through the command: a separable task is learned and transfers,
random labels stay at chance; the bag-of-tokens classifier is the optimum of its objective."""

import json

import numpy as np
import pytest
import torch

from megatron_rembert.eval.baselines import L2_WEIGHT, fit_logistic, majority_rate
from megatron_rembert.eval.cli import main
from tests.eval.sets import classification

ARGS = ["--seeds", "2", "--epochs", "4", "--lr", "2e-3", "--quiet"]


def _run(checkpoint, train, test, out, extra=()) -> dict:
    assert main(["--checkpoint", str(checkpoint), "--classify-train", str(train),
                 "--classify-test", str(test), "--out", str(out), *ARGS, *extra]) == 0
    return json.loads(out.read_text())["classification"]


def test_separable_labels_are_learned_in_every_language(checkpoint, corpus_and_tokenizer,
                                                        tmp_path):
    train, test = classification(tmp_path, corpus_and_tokenizer[0], random_labels=False)
    res = _run(checkpoint, train, test, tmp_path / "r.json", ["--baselines", "bag,chance"])
    assert res["train_lang"] == "en" and res["train_examples"] == 150
    assert res["labels"] == ["0", "1"]
    for lang in ("en", "xx"):  # xx: other words, the same label words
        entry = res["languages"][lang]
        assert entry["model"]["mean"] >= 0.9, (lang, entry)
        assert len(entry["model"]["runs"]) == 2
        assert entry["bag"]["accuracy"] == 1.0
        assert entry["majority"] == 0.5 and entry["uniform"] == 0.5
    runs = res["average"]["model"]["runs"]
    assert runs == pytest.approx([np.mean([res["languages"][g]["model"]["runs"][s]
                                           for g in ("en", "xx")]) for s in range(2)])
    assert res["average_transfer"]["languages"] == ["xx"]


def test_random_labels_stay_near_chance(checkpoint, corpus_and_tokenizer, tmp_path):
    train, test = classification(tmp_path, corpus_and_tokenizer[0], random_labels=True)
    res = _run(checkpoint, train, test, tmp_path / "r.json", ["--baselines", "chance"])
    labels = [json.loads(line) for line in test.read_text().splitlines()]
    for lang in ("en", "xx"):
        entry = res["languages"][lang]
        mine = [str(r["label"]) for r in labels if r["lang"] == lang]
        assert entry["majority"] == majority_rate(mine)
        # 60 test examples: a classifier without signal is within 0.25 of 1/2 (binomial sd 0.065)
        for acc in entry["model"]["runs"]:
            assert abs(acc - 0.5) < 0.25, (lang, entry)


def test_logistic_regression_reaches_the_optimum_of_its_objective():
    """At the minimum of mean CE + l2/2 |W|^2 the gradient vanishes: checked in numpy."""
    gen = torch.Generator().manual_seed(0)
    x = torch.poisson(torch.rand(80, 30, generator=gen) * 2).double()
    y = torch.randint(0, 3, (80,), generator=gen)
    w, b = fit_logistic(x, y.tolist(), 3)
    X, W, B = x.numpy(), w.numpy(), b.numpy()
    logits = X @ W.T + B
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(80), y.numpy()] -= 1.0  # d CE / d logits, times N
    grad_w = p.T @ X / 80 + L2_WEIGHT * W
    grad_b = p.sum(0) / 80
    assert np.abs(grad_w).max() < 1e-6 and np.abs(grad_b).max() < 1e-6
    assert np.abs(W).max() > 0.1  # not the zero start
