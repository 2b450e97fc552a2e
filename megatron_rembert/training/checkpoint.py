"""Saving the trainer's state into, and loading it from, the DeepSpeed engine.

The folder protocol (`complete`, `latest`, meta.json, manifest.json, pruning) is
megatron_rembert/checkpoint/step_folder.py, and what a resume decides before the model is built
(how a checkpoint loads at this layout, what changes) is checkpoint/resume.py; this module is
what needs the engine. Each step folder holds DeepSpeed's per-rank files plus
`rng/rank_XXXXX.pt` (each rank's dropout RNG states). Every file DeepSpeed writes goes through
`GuardedCheckpointEngine`, which hashes it right after writing (each rank its own files, in
parallel) and reads only with `torch.load(weights_only=True)`: a pickle that carries code is
refused, never run, even in a checkpoint that predates manifests.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

from megatron_rembert.checkpoint import CheckpointError
from megatron_rembert.checkpoint.files import deepspeed_safe_globals, torch_load_weights
from megatron_rembert.checkpoint.portable import is_portable
from megatron_rembert.checkpoint.reader import CheckpointReader
from megatron_rembert.checkpoint.step_folder import (
    COMPLETE,
    LATEST,
    StepFolder,
    commit,
    step_tag,
    verify,
)
from megatron_rembert.fs import HashingFile, atomic_write_json, sha256_file
from megatron_rembert.parallel import comm
from megatron_rembert.parallel import random as tp_random
from megatron_rembert.training.full_tensors import load_full_tensors, load_portable

RECORDS = ".hashes"  # per-rank hashes of one save, merged into manifest.json by rank 0


@dataclass
class ResumeState:
    step: int
    consumed_samples: int


class GuardedCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, hashing what it saves and loading weights only."""

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.records: dict[str, dict] = {}  # absolute path -> {"size", "sha256"}

    def save(self, state_dict, path: str) -> None:
        # torch.save writes a path from C++ several times faster than through a Python file
        # object, so the file is hashed right after, from the page cache, by the rank that
        # wrote it (bench/checkpoint_hash.py).
        torch.save(state_dict, path, _use_new_zipfile_serialization=self.zipfile_serialization)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # on disk before `complete` names the folder good
        finally:
            os.close(fd)
        self.records[str(Path(path).resolve())] = {"size": os.path.getsize(path),
                                                   "sha256": sha256_file(path)}

    def load(self, path: str, map_location=None):
        return torch_load_weights(path, allowed=deepspeed_safe_globals(),
                                  map_location=map_location or "cpu")


def _guard(engine) -> GuardedCheckpointEngine:
    current = getattr(engine, "checkpoint_engine", None)
    if not isinstance(current, GuardedCheckpointEngine):
        engine.checkpoint_engine = GuardedCheckpointEngine(engine._config)
    return engine.checkpoint_engine


def _non_finite_parameters(engine) -> int:
    # A sum is inf or NaN when an element is (or, for weights beyond ~1e31, when it overflows:
    # a state no less broken); one cheap reduction per tensor instead of a mask per element.
    sums = [p.detach().sum(dtype=torch.float32) for p in engine.module.parameters()]
    return int((~torch.stack(sums).isfinite()).sum()) if sums else 0


def save_checkpoint(engine, save_dir: str | Path, step: int, consumed_samples: int, meta: dict,
                    keep_last: int) -> Path:
    """Every rank calls this; returns the new folder once it is complete and `latest`.

    Refuses (CheckpointError, nothing written) when any weight is non-finite; a failed write
    (full disk, read-only file system) leaves `latest` naming the last good checkpoint.
    """
    save_dir = Path(save_dir)
    folder = save_dir / step_tag(step)
    (bad,) = comm.all_reduce_values([float(_non_finite_parameters(engine))])
    if bad:
        raise CheckpointError(
            f"step {step}: {int(bad)} parameter tensor(s) hold inf or NaN; not saved, "
            f"{save_dir / LATEST} still names the last good checkpoint. Lower "
            "optim.lr or check the data, then resume")
    if comm.rank() == 0 and folder.exists():  # a partial folder left by a kill at this step
        shutil.rmtree(folder, ignore_errors=True)
    comm.barrier()
    guard = _guard(engine)
    guard.records.clear()

    def failure(error: BaseException | None, ranks: int) -> CheckpointError:
        # A full disk, a read-only file system, a lost mount: said the same way on every rank.
        reason = f": {error.strerror or error}" if error else ""
        return CheckpointError(f"saving {folder} failed on {ranks} rank(s){reason}; "
                               f"{save_dir / LATEST} still names the last good checkpoint")

    try:
        with comm.agree_or_raise(OSError, failure):
            _save_files(engine, guard, save_dir, folder, step, consumed_samples)
        with comm.agree_or_raise(OSError, failure):
            if comm.rank() == 0:
                records = {}  # a part not seen here only means write_manifest hashes those again
                for part in sorted((folder / RECORDS).glob("rank_*.json")):
                    records.update(json.loads(part.read_text()))
                shutil.rmtree(folder / RECORDS)
                commit(save_dir, folder,
                       {**meta, "step": step, "consumed_samples": consumed_samples},
                       records, keep_last)
    except CheckpointError:
        if comm.rank() == 0 and not (folder / COMPLETE).exists():
            shutil.rmtree(folder, ignore_errors=True)  # the partial folder of a failed save
        raise
    return folder


def _save_files(engine, guard: GuardedCheckpointEngine, save_dir: Path, folder: Path,
                step: int, consumed_samples: int) -> None:
    """This rank's files of the step folder: DeepSpeed's, its RNG states, and its hashes."""
    engine.save_checkpoint(str(save_dir), tag=folder.name, save_latest=False,
                           client_state={"step": step, "consumed_samples": consumed_samples})
    rng_file = folder / "rng" / f"rank_{comm.rank():05d}.pt"
    rng_file.parent.mkdir(parents=True, exist_ok=True)
    with HashingFile(rng_file) as f:
        torch.save(tp_random.get_rng_states(), f)
    guard.records[str(rng_file.resolve())] = f.record()
    # Each rank's hashes, as paths relative to the folder (nodes may mount it elsewhere),
    # go into a small file of their own; rank 0 merges them into the manifest.
    root = folder.resolve()
    atomic_write_json(folder / RECORDS / f"rank_{comm.rank():05d}.json",
                      {str(Path(p).relative_to(root)): r
                       for p, r in guard.records.items() if Path(p).is_relative_to(root)})


def load_checkpoint(engine, step: StepFolder, how: str = "same") -> ResumeState:
    """Restore model, optimizer, LR schedule, loss scaler and (same layout) RNG states.

    The folder is checked against its manifest before any file is opened. `how`: what
    `checkpoint.resume.check_layout` decided ('same', 'deepspeed' or 'full'). A portable
    checkpoint (written by `convert from-hf` or `reshard`) and, with 'full', one of ours saved
    at another layout load as full tensors (via `CheckpointReader`): the weights, the optimizer
    state unless weights only, no RNG states.
    """
    folder, meta = step.path, step.meta
    with comm.agree_or_raise(CheckpointError, lambda error, ranks: error or CheckpointError(
            f"{folder}: a file differs from its manifest.json (another rank's error names it)")):
        verify(folder, share=(comm.rank(), comm.world_size()))  # the ranks split the hashing
    if is_portable(meta):
        load_portable(engine, step)
        return ResumeState(step=int(meta["step"]), consumed_samples=int(meta["consumed_samples"]))
    if how == "full":
        with CheckpointReader(step, verify_files=False) as reader:
            load_full_tensors(engine, reader, {**meta, "weights_only": False,
                                               "optimizer": reader.optimizer_meta()})
        return ResumeState(step=int(meta["step"]), consumed_samples=int(meta["consumed_samples"]))
    _guard(engine)
    path, client = engine.load_checkpoint(str(folder.parent), tag=folder.name,
                                          load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if path is None:
        raise CheckpointError(f"{folder}: DeepSpeed found no model states to load")
    rng_file = folder / "rng" / f"rank_{comm.rank():05d}.pt"
    if how == "same" and rng_file.exists():
        tp_random.set_rng_states(torch_load_weights(rng_file, mmap=False))
    return ResumeState(step=client["step"], consumed_samples=client["consumed_samples"])
