"""The loader: DP ranks split each global batch, results independent of worker count, exact
resume from consumed_samples, validation iterator, torch output types, shard checksums."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest
import torch

from megatron_rembert.data import shards
from megatron_rembert.data.batch import FIELDS
from megatron_rembert.data.common import DataError
from megatron_rembert.data.config import DataConfig
from megatron_rembert.data.loader import build_pretraining_loader, build_validation_loader
from megatron_rembert.data.schedule import DataPlan
from megatron_rembert.parallel.layout import Layout
from tests.data.conftest import set_token, shard_entries


def _take(data_dir, n, micro_batch_size=2, dp_rank=0, dp_size=1, whole_word_mask=False,
          **kw):
    data = DataConfig(path=str(data_dir), seq_length=64, whole_word_mask=whole_word_mask)
    layout = Layout.build(dp_size, dp_rank, micro_batch_size=micro_batch_size,
                          global_batch_size=8)
    args = dict(seed=11, num_workers=0, num_micro_batches=n, return_tensors="np")
    args.update(kw)
    return list(build_pretraining_loader(data, layout, _plan(data), **args))


def _plan(data: DataConfig) -> DataPlan:
    """One step's schedule (none), validation at the default rate."""
    return DataPlan.resolve(data, 1, data.mask_prob)


def _validation(data_dir, dp_rank):
    data = DataConfig(path=str(data_dir), seq_length=64)
    return list(build_validation_loader(data, Layout.build(2, dp_rank, micro_batch_size=2),
                                        _plan(data), seed=3, per_language=256,
                                        return_tensors="np"))


@pytest.mark.multiprocess
def test_ranks_split_the_global_batch_and_workers_do_not_matter(dataset):
    single = _take(dataset, 6, micro_batch_size=4)  # dp=1: 2 micro-batches of 4 per step
    ranks = [_take(dataset, 6, dp_rank=r, dp_size=2, num_workers=2 if r else 0)
             for r in range(2)]
    for step in range(3):
        whole = np.concatenate([single[2 * step + j]["input_ids"] for j in range(2)])
        # rank 0's two micro-batches, then rank 1's: the global batch in order
        parts = np.concatenate([ranks[r][2 * step + j]["input_ids"]
                                for r in range(2) for j in range(2)])
        np.testing.assert_array_equal(whole, parts)


def test_resume_is_exact(dataset):
    full = _take(dataset, 12)  # 4 micro-batches per step
    resumed = _take(dataset, 4, consumed_samples=16)  # resume at step 2
    for a, b in zip(full[8:], resumed, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    with pytest.raises(DataError, match="consumed_samples 5"):
        _take(dataset, 1, consumed_samples=5)


def test_torch_batch_and_whole_word(dataset, tokenizer):
    (b,) = _take(dataset, 1, return_tensors="pt", whole_word_mask=True)
    assert set(b) == {"input_ids", "attention_mask", "token_type_ids", "masked_positions",
                      "masked_labels", "masked_weights", "unpadded"}
    assert b["unpadded"].tolist() == [int(b["attention_mask"].all())]
    assert {k: v.dtype for k, v in b.items()} == {
        k: torch.from_numpy(np.zeros(0, f.dtype)).dtype for k, f in FIELDS.items()}
    assert b["attention_mask"].dtype == torch.int64 and b["input_ids"].shape == (2, 64)
    assert b["masked_positions"].shape == (2, 16) and b["masked_weights"].sum() > 0


def test_validation_loader(dataset):
    a, b = _validation(dataset, 0), _validation(dataset, 1)
    assert len(a) == len(b) > 0
    again = _validation(dataset, 0)
    np.testing.assert_array_equal(a[0]["input_ids"], again[0]["input_ids"])
    assert not np.array_equal(a[0]["input_ids"], b[0]["input_ids"])


def flip_one_token_per_shard(data_dir, split: str = "train") -> None:
    """A changed token id in every shard of `split`, still inside the vocabulary: only the
    manifest's sha256 can tell."""
    for entry in shard_entries(data_dir, split):
        set_token(data_dir / entry["file"], row=0, position=1, value=lambda old: old ^ 1)


def test_shard_checksums_checked_off_thread_before_use(dataset, tmp_path, monkeypatch):
    copy = tmp_path / "ds"
    shutil.copytree(dataset, copy)
    flip_one_token_per_shard(copy)
    hashed = []  # (thread, file name)
    real = shards.sha256_file

    def sha256_file(path):
        hashed.append((threading.current_thread().name, path.name))
        return real(path)

    monkeypatch.setattr(shards, "sha256_file", sha256_file)
    data = DataConfig(path=str(copy), seq_length=64)
    loader = build_pretraining_loader(data, Layout.build(1, 0, micro_batch_size=2,
                                                         global_batch_size=8),
                                      _plan(data), seed=11, num_workers=0)
    # The first micro-batch is held back: no sample of a shard that fails reaches the trainer.
    with pytest.raises(DataError, match=r"train-\d+\.arrow: sha256 differs from the manifest"):
        next(loader)
    # Sound validation shards pass; each file is hashed once per process, off this thread.
    for _ in range(2):
        assert len(list(build_validation_loader(data, Layout.build(1, 0, micro_batch_size=2),
                                                _plan(data), seed=3, per_language=256,
                                                return_tensors="np")))
    assert {thread for thread, _ in hashed} == {"shard-sha256"}
    names = [name for _, name in hashed]
    assert len(names) == len(set(names)) and any("-valid-" in name for name in names)
