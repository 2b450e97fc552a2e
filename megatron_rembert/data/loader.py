"""Micro-batch loaders for the trainer: worker processes, bounded prefetch, in-order delivery.

Every micro-batch is a pure function of its number (sample indices from the sampler, masks
from (seed, sample index) at the mask rate of the step the sample belongs to), so workers can
build them in any order and the loader hands them out in order; the result does not depend on
`num_workers`.

A batch is handed out only once the background sha256 checks of the shards it read have
passed (`ShardDataset.wait_verified`, in the training process); every token id is checked
against the vocabulary when the rows are read (`ShardDataset.get`, in the workers).

Yielded batches are dicts with the keys, dtypes and shapes of `batch.FIELDS` (made by
`masking.mask_batch`): `input_ids`, `attention_mask`, `token_type_ids`, `masked_positions`,
`masked_labels` int64 and `masked_weights` float32, and `unpadded` (shape (1,), int64: 1 when
the micro-batch holds no padding, so that attention can skip its mask and run FlashAttention
on CUDA), as torch tensors (`return_tensors="pt"`, the default; CPU, the trainer moves them)
or numpy arrays.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.pool
import os
import pickle
import signal
from collections.abc import Iterator
from multiprocessing import resource_tracker

import numpy as np

from megatron_rembert.data.common import DataError, Ready, ordered_map
from megatron_rembert.data.config import DataConfig
from megatron_rembert.data.masking import MaskingConfig, mask_batch
from megatron_rembert.data.sampler import ScheduledSampler, rank_sample_indices, rng_for
from megatron_rembert.data.schedule import DataPlan, Schedule
from megatron_rembert.data.shards import ShardDataset
from megatron_rembert.parallel.layout import Layout


class TrainBatches:
    """Micro-batch j of this rank (j = 0, 1, ... from the resume point) -> batch dict."""

    def __init__(self, dataset: ShardDataset, sampler: ScheduledSampler, masking: MaskingConfig,
                 word_starts, layout: Layout, consumed_samples: int, schedule: Schedule):
        if consumed_samples % layout.global_batch_size:
            raise DataError(f"consumed_samples {consumed_samples} is not a multiple of the global "
                            f"batch size {layout.global_batch_size}; resume with the global batch "
                            "size the checkpoint was trained with.")
        self.dataset, self.sampler, self.masking, self.word_starts = (
            dataset, sampler, masking, word_starts)
        self.layout, self.schedule = layout, schedule
        self.first_step = consumed_samples // layout.global_batch_size

    def indices(self, j: int) -> np.ndarray:
        step, micro = divmod(j, self.layout.gas)
        return rank_sample_indices(self.first_step + step, micro, self.layout)

    def mask_probs(self, idx: np.ndarray) -> np.ndarray:
        """The scheduled mask rate of each sample: that of the step it belongs to."""
        steps = idx // self.layout.global_batch_size
        return np.array([self.schedule.mask_prob(s) for s in steps.tolist()])

    def __call__(self, j: int) -> dict[str, np.ndarray]:
        idx = self.indices(j)
        lang, row = self.sampler(idx)
        return mask_batch(self.dataset.get(lang, row), idx, self.masking, self.word_starts,
                          self.mask_probs(idx))

    def ready(self, j: int) -> None:
        """Return once the shards micro-batch j reads have passed their sha256 checks."""
        if self.dataset.verifying:
            self.dataset.wait_verified(*self.sampler(self.indices(j)))


class ValidBatches:
    """The fixed validation set, one language at a time: for each language the first
    min(per_language, its rows) of its validation rows in an order shuffled by
    rng(seed, 3, language) (a pure function of the seed: the same sequences in every layout and
    after every resume), masked at `masking.mask_prob` with the generator of the row's index in
    manifest order.

    Micro-batch j of language l on this rank takes the positions of its sample indices in a
    global batch (`rank_sample_indices`); positions past the language's set are padding rows
    with all masked_weights 0, so that every rank runs whole global batches."""

    def __init__(self, dataset: ShardDataset, masking: MaskingConfig, word_starts,
                 layout: Layout, per_language: int, seed: int):
        self.dataset, self.masking, self.word_starts = dataset, masking, word_starts
        self.layout = layout
        self.languages = list(dataset.languages)
        counts = [dataset.rows_per_language[lang] for lang in self.languages]
        self.first_index = np.cumsum(counts) - counts  # manifest-order index of row 0
        self.rows = [rng_for(seed, 3, li).permutation(n)[:min(per_language, n)]
                     for li, n in enumerate(counts)]

    def num_batches(self, lang: int) -> int:
        """Micro-batches of this rank for language `lang`: whole global batches."""
        g = self.layout.global_batch_size
        return -(-len(self.rows[lang]) // g) * self.layout.gas

    def positions(self, lang: int, j: int) -> np.ndarray:
        step, micro = divmod(j, self.layout.gas)
        return rank_sample_indices(step, micro, self.layout)

    def __call__(self, lang: int, j: int) -> dict[str, np.ndarray]:
        pos = self.positions(lang, j)
        rows = self.rows[lang]
        real = pos < len(rows)
        row = rows[np.where(real, pos, 0)]  # padding repeats a real row, with weights 0
        batch = mask_batch(self.dataset.get(np.full(len(row), lang), row),
                           self.first_index[lang] + row, self.masking, self.word_starts)
        batch["masked_weights"][~real] = 0.0  # the attention mask (and `unpadded`) stay
        return batch

    def ready(self, lang: int) -> None:
        """Return once the shards of language `lang`'s set have passed their sha256 checks."""
        if self.dataset.verifying and len(self.rows[lang]):
            self.dataset.wait_verified(np.full(len(self.rows[lang]), lang), self.rows[lang])

    def batches(self, lang: int, return_tensors: str = "pt") -> list[dict]:
        """This rank's micro-batches of language `lang`, built in this process."""
        self.ready(lang)
        out = [self(lang, j) for j in range(self.num_batches(lang))]
        return [_to_torch(b) for b in out] if return_tensors == "pt" else out


_MAKE = None
# Stop signals are for the rank (training/signals.py), which still needs its workers for the
# step it finishes before saving; yet they reach the workers too: torchrun signals each rank's
# process group, a scheduler every process of the job. A worker killed while it waits for a
# task dies holding the pool's task-queue lock, and the rank's Pool.terminate() then waits
# for that lock for ever: the rank never exits (issue 30). So the workers ignore these
# signals, from their first instruction on (the rank starts them with the signals blocked and
# `_init` ignores them before unblocking), and the pool ends them with SIGKILL (`_Pool`).
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGUSR1, signal.SIGINT}


class _Pool(multiprocessing.pool.Pool):
    """multiprocessing's Pool, whose terminate() ends its workers with SIGKILL: they ignore
    SIGTERM. It sends it once it holds the task-queue lock, so no worker dies holding that."""

    @staticmethod
    def Process(ctx, *args, **kwargs):  # noqa: N802 - Pool's name for this hook
        process = ctx.Process(*args, **kwargs)
        process.terminate = process.kill
        return process


def _init(make_pickled: bytes) -> None:
    # An initializer that raises (or arguments that fail to unpickle) makes
    # multiprocessing.Pool respawn workers forever, so a failure is kept and raised from the
    # first task instead, where the caller sees it.
    global _MAKE
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # also drops one sent while the worker started
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    try:
        _MAKE = pickle.loads(make_pickled)
    except BaseException as e:  # noqa: BLE001 - re-raised in _run
        _MAKE = e


def _run(j: int):
    if isinstance(_MAKE, BaseException):
        raise _MAKE
    return _MAKE(j)


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
        # The workers, and the pool's threads, which start any replacement worker, inherit
        # this mask. So does multiprocessing's resource tracker (a process of the rank's
        # group too), which ignores SIGINT and SIGTERM itself but not SIGUSR1: killed by it,
        # it was relaunched without its records and printed a KeyError traceback for each
        # semaphore the pool freed. Starting it unblocks SIGINT and SIGTERM in this thread,
        # hence the second block.
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            resource_tracker.ensure_running()
            signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
            pool = _Pool(num_workers, _init, (pickle.dumps(make),),
                         context=mp.get_context(mp_context))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)

        def submit(j):
            return pool.apply_async(_run, (j,))
    else:
        def submit(j):
            return Ready(make(j))
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


def _setup(data: DataConfig, split: str, tokenizer_sha256: str | None, seed: int,
           plan: DataPlan, mask_prob: float):
    """The dataset, its masking (at `mask_prob`, P wide: the plan's, the same for training
    and validation) and word starts."""
    ds = ShardDataset(data.path, split, tokenizer_sha256=tokenizer_sha256,
                      seq_length=data.seq_length, verify_in_background=True)
    masking = MaskingConfig(
        vocab_size=ds.vocab_size, seed=seed, mask_prob=mask_prob,
        whole_word_mask=data.whole_word_mask, max_predictions=plan.max_predictions,
        special_ids=ds.special_ids)
    return ds, masking, ds.word_starts() if data.whole_word_mask else None


def build_sampler(data: DataConfig, ds: ShardDataset, schedule: Schedule, global_batch_size: int,
                  seed: int) -> ScheduledSampler:
    """The training sample stream of `schedule`; unknown languages in data.language_start
    are refused here too (the trainer checks them at start-up)."""
    unknown = sorted(set(data.language_start) - set(ds.languages))
    if unknown:
        raise DataError(f"data.language_start names {unknown}, which {data.path} does not have "
                        f"(its languages: {', '.join(ds.languages)})")
    segments = [(step * global_batch_size, alpha, active)
                for step, alpha, active in schedule.segments(ds.languages)]
    return ScheduledSampler([ds.rows_per_language[x] for x in ds.languages],
                            [ds.tokens_per_language[x] for x in ds.languages], segments, seed)


def build_pretraining_loader(
    data: DataConfig, layout: Layout, plan: DataPlan, *, seed: int,
    tokenizer_sha256: str | None = None, consumed_samples: int = 0,
    num_workers: int | None = None, prefetch: int = 4, return_tensors: str = "pt",
    num_micro_batches: int | None = None,
) -> Iterator[dict]:
    """Endless micro-batches of this data-parallel rank (`layout.dp_rank`), in order, starting
    at `consumed_samples` (a multiple of the global batch). One optimizer step consumes
    `layout.gas` of them.

    Special ids and the vocabulary size come from the dataset's manifest (the trainer checks
    them against the model before, in `training.inputs.check_inputs`). `plan` (the run's, see
    `DataPlan.resolve`) gives the schedules and P. `num_workers` defaults to
    `data.num_workers`; `num_micro_batches` (default: endless) stops the stream."""
    ds, masking, ws = _setup(data, "train", tokenizer_sha256, seed, plan, data.mask_prob)
    sampler = build_sampler(data, ds, plan.schedule, layout.global_batch_size, seed)
    make = TrainBatches(ds, sampler, masking, ws, layout, consumed_samples, plan.schedule)
    workers = data.num_workers if num_workers is None else num_workers
    return iterate_batches(make, 0, num_micro_batches, workers, prefetch, return_tensors)


def build_validation_set(
    data: DataConfig, layout: Layout, plan: DataPlan, *, seed: int, per_language: int,
    tokenizer_sha256: str | None = None,
) -> ValidBatches:
    """The fixed, stratified validation set (`ValidBatches`): up to `per_language` sequences
    of every language, masked at the plan's validation rate whatever the training schedule
    says, in batches as wide (P) as training's."""
    ds, masking, ws = _setup(data, "valid", tokenizer_sha256, seed, plan, plan.eval_mask_prob)
    return ValidBatches(ds, masking, ws, layout, per_language, seed)


def build_validation_loader(
    data: DataConfig, layout: Layout, plan: DataPlan, *, seed: int, per_language: int,
    tokenizer_sha256: str | None = None, return_tensors: str = "pt",
) -> Iterator[dict]:
    """One pass over the validation set of `build_validation_set`, language after language
    (same sequences and masks every time for a given seed), as this rank's micro-batches."""
    valid = build_validation_set(data, layout, plan, seed=seed, per_language=per_language,
                                 tokenizer_sha256=tokenizer_sha256)
    for lang in range(len(valid.languages)):
        yield from valid.batches(lang, return_tensors)
