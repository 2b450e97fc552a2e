"""Evaluation sets made from the demo corpus's sentences (deterministic)."""

from __future__ import annotations

import random
from pathlib import Path

from tests.eval.helpers import write_jsonl

N = 60  # pairs per language of the `parallel` sets (conftest.py)
MARKERS = ("alpha alpha", "omega omega")  # the separable task: the label's words lead the text


def sentences(corpus: Path, script: str, n: int) -> list[str]:
    """The first `n` distinct sentences (> 10 characters) of one script's plain-text files."""
    out: list[str] = []
    for path in sorted((corpus / script).glob("*.txt")):
        for line in path.read_text().splitlines():
            out += [s.strip() for s in line.split(".") if len(s.strip()) > 10]
    out = list(dict.fromkeys(out))
    assert len(out) >= n, (script, len(out))
    return out[:n]


def classification(folder: Path, corpus: Path, random_labels: bool, n_train: int = 150,
                   n_test: int = 60) -> tuple[Path, Path]:
    """en train/test and xx test examples; labels by MARKERS (separable) or at random."""
    rng = random.Random(0)
    en, xx = sentences(corpus, "latn_a", n_train + n_test), sentences(corpus, "latn_b", n_test)

    def rows(lang: str, texts: list[str]) -> list[dict]:
        out = []
        for i, text in enumerate(texts):
            label = rng.randrange(2) if random_labels else i % 2
            body = text if random_labels else f"{MARKERS[label]} {text}"
            out.append({"id": f"{lang}-{i}", "lang": lang, "label": label, "text": body})
        return out

    train = write_jsonl(folder / "train.jsonl", rows("en", en[:n_train]))
    test = write_jsonl(folder / "test.jsonl", rows("en", en[n_train:]) + rows("xx", xx))
    return train, test
