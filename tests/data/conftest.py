"""Shared small data: a demo corpus, a 1000-piece tokenizer and a dataset of 64-token rows,
built once per test session in a temp folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rembert.data.demo_corpus import make_demo_corpus
from megatron_rembert.data.preprocess import PreprocessConfig, preprocess
from megatron_rembert.data.tokenizer import train_tokenizer

SEQ = 64


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    make_demo_corpus(d, size_mb=0.4, seed=7)
    return d


@pytest.fixture(scope="session")
def tokenizer(corpus, tmp_path_factory) -> Path:
    prefix = tmp_path_factory.mktemp("tok") / "spm"
    train_tokenizer(corpus, prefix, vocab_size=1000, num_threads=2)
    return prefix.with_suffix(".model")


def small_config(corpus, out, tokenizer, **kw) -> PreprocessConfig:
    args = dict(seq_length=SEQ, workers=1, shard_size_mb=0.02, valid_fraction=0.05,
                progress=False)
    args.update(kw)
    return PreprocessConfig(str(corpus), str(out), str(tokenizer), **args)


@pytest.fixture(scope="session")
def dataset(corpus, tokenizer, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds")
    preprocess(small_config(corpus, out, tokenizer))
    return out
