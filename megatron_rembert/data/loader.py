"""Micro-batch loaders for the trainer: worker processes, bounded prefetch, in-order delivery.

Every micro-batch is a pure function of its number (sample indices from the sampler, masks
from (seed, sample index)), so workers can build them in any order and the loader hands them
out in order; the result does not depend on `num_workers`.

A batch is handed out only once the background sha256 checks of the shards it read have
passed (`ShardDataset.wait_verified`, in the training process); every token id is checked
against the vocabulary when the rows are read (`ShardDataset.get`, in the workers).

Yielded batches are dicts (see `masking.mask_batch` and `masking.BATCH_DTYPES`): `input_ids`,
`attention_mask`, `token_type_ids`, `masked_positions`, `masked_labels` int64 and
`masked_weights` float32, and `unpadded` (shape (1,), int64: 1 when the micro-batch holds no
padding, so that attention can skip its mask and run FlashAttention on CUDA), as torch
tensors (`return_tensors="pt"`, the default; CPU, the trainer moves them) or numpy arrays.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
from collections.abc import Iterator

import numpy as np

from megatron_rembert.data.common import DataError, ordered_map
from megatron_rembert.data.config import DataConfig
from megatron_rembert.data.masking import MaskingConfig, default_max_predictions, mask_batch
from megatron_rembert.data.sampler import MultilingualSampler, rank_sample_indices
from megatron_rembert.data.shards import ShardDataset
from megatron_rembert.parallel.layout import Layout


def unpadded_flag(attention_mask: np.ndarray) -> np.ndarray:
    """The batch key `unpadded`: [1] if no position of the micro-batch is padding, else [0].
    Packed rows (data/packing.py) fill the whole sequence, so it is 1 for nearly every packed
    micro-batch; the model then calls attention without a mask."""
    return np.array([int(np.asarray(attention_mask).all())], dtype=np.int64)


def add_unpadded_flag(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**batch, "unpadded": unpadded_flag(batch["attention_mask"])}


class TrainBatches:
    """Micro-batch j of this rank (j = 0, 1, ... from the resume point) -> batch dict."""

    def __init__(self, dataset: ShardDataset, sampler: MultilingualSampler, masking: MaskingConfig,
                 word_starts, layout: Layout, consumed_samples: int):
        if consumed_samples % layout.global_batch_size:
            raise DataError(f"consumed_samples {consumed_samples} is not a multiple of the global "
                            f"batch size {layout.global_batch_size}; resume with the global batch "
                            "size the checkpoint was trained with.")
        self.dataset, self.sampler, self.masking, self.word_starts = (
            dataset, sampler, masking, word_starts)
        self.layout = layout
        self.first_step = consumed_samples // layout.global_batch_size

    def indices(self, j: int) -> np.ndarray:
        step, micro = divmod(j, self.layout.gas)
        return rank_sample_indices(self.first_step + step, micro, self.layout)

    def __call__(self, j: int) -> dict[str, np.ndarray]:
        idx = self.indices(j)
        lang, row = self.sampler(idx)
        return add_unpadded_flag(
            mask_batch(self.dataset.get(lang, row), idx, self.masking, self.word_starts))

    def ready(self, j: int) -> None:
        """Return once the shards micro-batch j reads have passed their sha256 checks."""
        if self.dataset.verifying:
            self.dataset.wait_verified(*self.sampler(self.indices(j)))


class ValidBatches:
    """The validation split in manifest order, micro-batch j of this rank. Global validation
    batch g is rows [g*m*dp, (g+1)*m*dp); rank r takes the r-th slice of m rows; a last
    incomplete global batch is dropped so that every rank sees the same number of batches."""

    def __init__(self, dataset: ShardDataset, masking: MaskingConfig, word_starts,
                 layout: Layout):
        self.dataset, self.masking, self.word_starts = dataset, masking, word_starts
        self.m, self.r, self.dp = layout.micro_batch_size, layout.dp_rank, layout.dp
        counts = [dataset.rows_per_language[lang] for lang in dataset.languages]
        self.lang_of = np.repeat(np.arange(len(counts)), counts)
        self.row_of = np.concatenate([np.arange(c) for c in counts]) if counts else np.zeros(0)
        self.num_batches = len(self.lang_of) // (self.m * self.dp)

    def indices(self, j: int) -> np.ndarray:
        start = (j * self.dp + self.r) * self.m
        return np.arange(start, start + self.m)

    def __call__(self, j: int) -> dict[str, np.ndarray]:
        idx = self.indices(j)
        ids = self.dataset.get(self.lang_of[idx], self.row_of[idx])
        return add_unpadded_flag(mask_batch(ids, idx, self.masking, self.word_starts))

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


def _setup(data: DataConfig, split: str, tokenizer_sha256: str | None, seed: int):
    ds = ShardDataset(data.path, split, tokenizer_sha256=tokenizer_sha256,
                      seq_length=data.seq_length, verify_in_background=True)
    masking = MaskingConfig(
        vocab_size=ds.vocab_size, seed=seed, mask_prob=data.mask_prob,
        whole_word_mask=data.whole_word_mask,
        max_predictions=(data.max_predictions
                         or default_max_predictions(ds.seq_length, data.mask_prob)),
        special_ids=ds.special_ids)
    return ds, masking, ds.word_starts() if data.whole_word_mask else None


def build_pretraining_loader(
    data: DataConfig, layout: Layout, *, seed: int, tokenizer_sha256: str | None = None,
    consumed_samples: int = 0, num_workers: int | None = None, prefetch: int = 4,
    return_tensors: str = "pt", num_micro_batches: int | None = None,
) -> Iterator[dict]:
    """Endless micro-batches of this data-parallel rank (`layout.dp_rank`), in order, starting
    at `consumed_samples` (a multiple of the global batch). One optimizer step consumes
    `layout.gas` of them.

    Special ids and the vocabulary size come from the dataset's manifest (the trainer checks
    them against the model before, in `training.loop.check_inputs`). P =
    `data.max_predictions`, 0 for `default_max_predictions(seq_length, mask_prob)`.
    `num_workers` defaults to `data.num_workers`; `num_micro_batches` (default: endless)
    stops the stream."""
    ds, masking, ws = _setup(data, "train", tokenizer_sha256, seed)
    sampler = MultilingualSampler([ds.rows_per_language[x] for x in ds.languages],
                                  [ds.tokens_per_language[x] for x in ds.languages], data.alpha,
                                  seed)
    make = TrainBatches(ds, sampler, masking, ws, layout, consumed_samples)
    workers = data.num_workers if num_workers is None else num_workers
    return iterate_batches(make, 0, num_micro_batches, workers, prefetch, return_tensors)


def build_validation_loader(
    data: DataConfig, layout: Layout, *, seed: int, tokenizer_sha256: str | None = None,
    max_batches: int | None = None, num_workers: int = 0, return_tensors: str = "pt",
) -> Iterator[dict]:
    """One pass over the validation split (same masks every time for a given seed): the same
    number of micro-batches on every rank, at most `max_batches`."""
    ds, masking, ws = _setup(data, "valid", tokenizer_sha256, seed)
    make = ValidBatches(ds, masking, ws, layout)
    n = make.num_batches if max_batches is None else min(max_batches, make.num_batches)
    return iterate_batches(make, 0, n, num_workers, 2, return_tensors)
