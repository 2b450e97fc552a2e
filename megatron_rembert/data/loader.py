"""Micro-batch loaders for the trainer: worker processes, bounded prefetch, in-order delivery.

Every micro-batch is a pure function of its number (sample indices from the sampler, masks
from (seed, sample index)), so workers can build them in any order and the loader hands them
out in order; the result does not depend on `num_workers`.

A batch is handed out only once the background sha256 checks of the shards it read have
passed (`ShardDataset.wait_verified`, in the training process); every token id is checked
against the vocabulary when the rows are read (`ShardDataset.get`, in the workers).

Yielded batches are dicts (see `masking.mask_batch` and `masking.BATCH_DTYPES`): `input_ids`,
`attention_mask`, `token_type_ids`, `masked_positions`, `masked_labels` int64 and
`masked_weights` float32, as
torch tensors (`return_tensors="pt"`, the default; CPU, the trainer moves them) or numpy arrays.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
from collections.abc import Iterator

import numpy as np

from megatron_rembert.data.common import DataError, ordered_map
from megatron_rembert.data.masking import MaskingConfig, default_max_predictions, mask_batch
from megatron_rembert.data.sampler import (
    MultilingualSampler,
    check_batch_sizes,
    rank_sample_indices,
)
from megatron_rembert.data.shards import ShardDataset


class TrainBatches:
    """Micro-batch j of this rank (j = 0, 1, ... from the resume point) -> batch dict."""

    def __init__(self, dataset: ShardDataset, sampler: MultilingualSampler, masking: MaskingConfig,
                 word_starts, micro_batch_size: int, global_batch_size: int, dp_rank: int,
                 dp_size: int, consumed_samples: int):
        check_batch_sizes(global_batch_size, micro_batch_size, dp_size)
        if consumed_samples % global_batch_size:
            raise DataError(f"consumed_samples {consumed_samples} is not a multiple of the global "
                            f"batch size {global_batch_size}; resume with the global batch size "
                            "the checkpoint was trained with.")
        self.dataset, self.sampler, self.masking, self.word_starts = (
            dataset, sampler, masking, word_starts)
        self.m, self.G, self.r, self.dp = micro_batch_size, global_batch_size, dp_rank, dp_size
        self.first_step = consumed_samples // global_batch_size
        self.micro_per_step = global_batch_size // (micro_batch_size * dp_size)

    def indices(self, j: int) -> np.ndarray:
        step, micro = divmod(j, self.micro_per_step)
        return rank_sample_indices(self.first_step + step, micro, self.G, self.m, self.r, self.dp)

    def __call__(self, j: int) -> dict[str, np.ndarray]:
        idx = self.indices(j)
        lang, row = self.sampler(idx)
        return mask_batch(self.dataset.get(lang, row), idx, self.masking, self.word_starts)

    def ready(self, j: int) -> None:
        """Return once the shards micro-batch j reads have passed their sha256 checks."""
        if self.dataset.verifying:
            self.dataset.wait_verified(*self.sampler(self.indices(j)))


class ValidBatches:
    """The validation split in manifest order, micro-batch j of this rank. Global validation
    batch g is rows [g*m*dp, (g+1)*m*dp); rank r takes the r-th slice of m rows; a last
    incomplete global batch is dropped so that every rank sees the same number of batches."""

    def __init__(self, dataset: ShardDataset, masking: MaskingConfig, word_starts,
                 micro_batch_size: int, dp_rank: int, dp_size: int):
        self.dataset, self.masking, self.word_starts = dataset, masking, word_starts
        self.m, self.r, self.dp = micro_batch_size, dp_rank, dp_size
        counts = [dataset.rows_per_language[lang] for lang in dataset.languages]
        self.lang_of = np.repeat(np.arange(len(counts)), counts)
        self.row_of = np.concatenate([np.arange(c) for c in counts]) if counts else np.zeros(0)
        self.num_batches = len(self.lang_of) // (micro_batch_size * dp_size)

    def indices(self, j: int) -> np.ndarray:
        start = (j * self.dp + self.r) * self.m
        return np.arange(start, start + self.m)

    def __call__(self, j: int) -> dict[str, np.ndarray]:
        idx = self.indices(j)
        ids = self.dataset.get(self.lang_of[idx], self.row_of[idx])
        return mask_batch(ids, idx, self.masking, self.word_starts)

    def ready(self, j: int) -> None:
        """Return once the shards micro-batch j reads have passed their sha256 checks."""
        if self.dataset.verifying:
            idx = self.indices(j)
            self.dataset.wait_verified(self.lang_of[idx], self.row_of[idx])


_MAKE = None


def _init(make_pickled: bytes) -> None:
    # An initializer that raises (or arguments that fail to unpickle) makes
    # multiprocessing.Pool respawn workers forever, so a failure is kept and raised from the
    # first task instead, where the caller sees it.
    global _MAKE
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Ctrl-C reaches the whole process group; the rank handles it (training/signals.py) and
    # still needs its loader for the step it finishes before saving.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _MAKE = pickle.loads(make_pickled)
    except BaseException as e:  # noqa: BLE001 - re-raised in _run
        _MAKE = e


def _run(j: int):
    if isinstance(_MAKE, BaseException):
        raise _MAKE
    return _MAKE(j)


class _Now:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


def iterate_batches(make, start: int = 0, stop: int | None = None, num_workers: int = 2,
                    prefetch: int = 4, return_tensors: str = "pt",
                    mp_context: str = "spawn") -> Iterator[dict]:
    """Yield make(start), make(start+1), ... (until `stop`, or forever), built by
    `num_workers` processes (0: in this process) with up to `prefetch` batches per worker in
    flight. "spawn" by default: safe after CUDA and threads are up in the trainer.

    If `make` has a `ready(j)` method, it is called here, in the calling process, before
    batch j is yielded (the loaders hold a batch there until its shards' checksums passed)."""
    ready = getattr(make, "ready", None)
    numbers = range(start, stop) if stop is not None else _count(start)
    pool = None
    if num_workers > 0:
        pool = mp.get_context(mp_context).Pool(num_workers, _init, (pickle.dumps(make),))

        def submit(j):
            return pool.apply_async(_run, (j,))
    else:
        def submit(j):
            return _Now(make(j))
    try:
        in_flight = max(1, prefetch * max(num_workers, 1))
        for j, batch in ordered_map(submit, numbers, in_flight):
            if ready is not None:
                ready(j)
            yield _to_torch(batch) if return_tensors == "pt" else batch
    finally:
        if pool is not None:
            pool.terminate()


def _count(start: int):
    while True:
        yield start
        start += 1


def _to_torch(batch: dict[str, np.ndarray]) -> dict:
    import torch

    return {k: torch.from_numpy(v) for k, v in batch.items()}


def _setup(data_dir, split, tokenizer_sha256, seq_length, vocab_size, seed, mask_prob,
           whole_word_mask, max_predictions):
    ds = ShardDataset(data_dir, split, tokenizer_sha256=tokenizer_sha256, seq_length=seq_length,
                      verify_in_background=True)
    if vocab_size is not None and vocab_size != ds.vocab_size:
        raise DataError(f"{data_dir}: tokenizer vocabulary has {ds.vocab_size} pieces, the run "
                        f"says vocab_size={vocab_size} (before padding); they must match.")
    masking = MaskingConfig(
        vocab_size=ds.vocab_size, seed=seed, mask_prob=mask_prob, whole_word_mask=whole_word_mask,
        max_predictions=max_predictions or default_max_predictions(ds.seq_length, mask_prob),
        special_ids=ds.special_ids)
    return ds, masking, ds.word_starts() if whole_word_mask else None


def build_pretraining_loader(
    data_dir: str, tokenizer_sha256: str | None, seq_length: int, micro_batch_size: int,
    global_batch_size: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 1234,
    consumed_samples: int = 0, alpha: float = 0.5, mask_prob: float = 0.15,
    whole_word_mask: bool = False, vocab_size: int | None = None,
    max_predictions: int | None = None, num_workers: int = 2, prefetch: int = 4,
    return_tensors: str = "pt", num_micro_batches: int | None = None,
) -> Iterator[dict]:
    """Endless micro-batches of this data-parallel rank, in order, starting at
    `consumed_samples` (a multiple of `global_batch_size`). One optimizer step consumes
    global_batch_size / (micro_batch_size * dp_size) of them.

    Special ids and the vocabulary size come from the dataset's manifest; `vocab_size`, when
    given, is checked against it (the unpadded tokenizer size). P = `max_predictions`, default
    `default_max_predictions(seq_length, mask_prob)`."""
    ds, masking, ws = _setup(data_dir, "train", tokenizer_sha256, seq_length, vocab_size, seed,
                             mask_prob, whole_word_mask, max_predictions)
    sampler = MultilingualSampler([ds.rows_per_language[x] for x in ds.languages],
                                  [ds.tokens_per_language[x] for x in ds.languages], alpha, seed)
    make = TrainBatches(ds, sampler, masking, ws, micro_batch_size, global_batch_size, dp_rank,
                        dp_size, consumed_samples)
    return iterate_batches(make, 0, num_micro_batches, num_workers, prefetch, return_tensors)


def build_validation_loader(
    data_dir: str, tokenizer_sha256: str | None, seq_length: int, micro_batch_size: int,
    dp_rank: int = 0, dp_size: int = 1, seed: int = 1234, mask_prob: float = 0.15,
    whole_word_mask: bool = False, vocab_size: int | None = None,
    max_predictions: int | None = None, max_batches: int | None = None, num_workers: int = 0,
    return_tensors: str = "pt",
) -> Iterator[dict]:
    """One pass over the validation split (same masks every time for a given seed): the same
    number of micro-batches on every rank, at most `max_batches`."""
    ds, masking, ws = _setup(data_dir, "valid", tokenizer_sha256, seq_length, vocab_size, seed,
                             mask_prob, whole_word_mask, max_predictions)
    make = ValidBatches(ds, masking, ws, micro_batch_size, dp_rank, dp_size)
    n = make.num_batches if max_batches is None else min(max_batches, make.num_batches)
    return iterate_batches(make, 0, n, num_workers, 2, return_tensors)
