"""Shared small data: a demo corpus, a 1000-piece tokenizer and a dataset of 64-token rows,
built once per test session in a temp folder."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from megatron_rembert.data.shards import read_shard_batches
from megatron_rembert.prep.demo_corpus import make_demo_corpus
from megatron_rembert.prep.preprocess import PreprocessConfig, preprocess
from megatron_rembert.prep.tokenizer import train_tokenizer

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


def shard_entries(data_dir: Path, split: str = "train") -> list[dict]:
    manifest = json.loads((data_dir / "manifest.json").read_text())
    return [s for s in manifest["shards"] if s["split"] == split]


def set_token(shard: Path, row: int, position: int, value: int | Callable[[int], int]) -> None:
    """Overwrite one token id in a shard file in place, with `value` or `value(old id)`. The
    size stays: only the checksum, or the range check, can tell."""
    data = bytearray(shard.read_bytes())
    _, (batch,) = read_shard_batches(shard, mmap=False)
    ids = batch.column(0).values.to_numpy().reshape(-1, SEQ).copy()
    start = bytes(data).find(ids[row].tobytes())  # where the row's int32s lie in the file
    assert start >= 0 and bytes(data).count(ids[row].tobytes()) == 1
    offset = start + 4 * position
    if callable(value):
        value = value(int(np.frombuffer(data[offset:offset + 4], np.int32)[0]))
    data[offset:offset + 4] = np.int32(value).tobytes()
    shard.write_bytes(bytes(data))
