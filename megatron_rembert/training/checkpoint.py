"""Saving the trainer's state into, and loading it from, the DeepSpeed engine.

The folder protocol (`complete`, `latest`, meta.json, manifest.json, pruning) is
megatron_rembert/checkpoint/folder.py; each step folder holds DeepSpeed's per-rank files plus
`rng/rank_XXXXX.pt` (each rank's dropout RNG states). Every file DeepSpeed writes goes through
`GuardedCheckpointEngine`, which hashes it right after writing (each rank its own files, in
parallel) and reads only with `torch.load(weights_only=True)`: a pickle that carries code is
refused, never run, even in a checkpoint that predates manifests.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

from megatron_rembert.checkpoint import CheckpointError
from megatron_rembert.checkpoint import folder as protocol
from megatron_rembert.checkpoint.files import deepspeed_safe_globals, torch_load_weights
from megatron_rembert.checkpoint.folder import find_latest, read_meta, step_tag
from megatron_rembert.checkpoint.portable import is_portable
from megatron_rembert.checkpoint.reader import CheckpointReader
from megatron_rembert.fs import HashingFile, atomic_write_json, sha256_file
from megatron_rembert.parallel import comm
from megatron_rembert.parallel import random as tp_random
from megatron_rembert.parallel.layout import Layout
from megatron_rembert.run_config import Config
from megatron_rembert.training.estimate import parameter_balanced_boundaries
from megatron_rembert.training.optim import lr_lambda
from megatron_rembert.training.portable import load_full_tensors, load_portable

RECORDS = ".hashes"  # per-rank hashes of one save, merged into manifest.json by rank 0

__all__ = ["CheckpointError", "ResumeState", "find_latest", "load_checkpoint", "read_meta",
           "save_checkpoint", "step_tag"]


@dataclass
class ResumeState:
    step: int
    consumed_samples: int
    path: Path


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
    tag = step_tag(step)
    folder = save_dir / tag
    (bad,) = comm.all_reduce_values([float(_non_finite_parameters(engine))])
    if bad:
        raise CheckpointError(
            f"step {step}: {int(bad)} parameter tensor(s) hold inf or NaN; not saved, "
            f"{save_dir / protocol.LATEST} still names the last good checkpoint. Lower "
            "optim.lr or check the data, then resume")
    error = None
    if comm.rank() == 0 and folder.exists():  # a partial folder left by a kill at this step
        shutil.rmtree(folder, ignore_errors=True)
    comm.barrier()
    guard = _guard(engine)
    guard.records.clear()
    try:
        engine.save_checkpoint(str(save_dir), tag=tag, save_latest=False,
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
    except OSError as err:  # a full disk, a read-only file system, a lost mount
        error = err
    _raise_if_any_failed(error, folder, save_dir)
    error = None
    if comm.rank() == 0:
        try:
            records = {}  # a part not seen here only means write_manifest hashes those again
            for part in sorted((folder / RECORDS).glob("rank_*.json")):
                records.update(json.loads(part.read_text()))
            shutil.rmtree(folder / RECORDS)
            protocol.commit(save_dir, folder,
                            {**meta, "step": step, "consumed_samples": consumed_samples},
                            records, keep_last)
        except OSError as err:
            error = err
    _raise_if_any_failed(error, folder, save_dir)
    return folder


def _raise_if_any_failed(error: OSError | None, folder: Path, save_dir: Path) -> None:
    """Agree across ranks (also the barrier); on failure remove the partial folder."""
    (failed,) = comm.all_reduce_values([0.0 if error is None else 1.0])
    if not failed:
        return
    if comm.rank() == 0 and not (folder / protocol.COMPLETE).exists():
        shutil.rmtree(folder, ignore_errors=True)
    reason = f": {error.strerror or error}" if error else ""
    raise CheckpointError(f"saving {folder} failed on {int(failed)} rank(s){reason}; "
                          f"{save_dir / protocol.LATEST} still names the last good checkpoint")


def reshard_command(folder: Path, tp: int, pp: int) -> str:
    out = f"{str(folder.parent).rstrip('/')}-tp{tp}-pp{pp}"
    return (f"python -m megatron_rembert.convert reshard --checkpoint {folder} --out {out} "
            f"--tp {tp} --pp {pp} --weights-only, then resume with --set train.save_dir={out}")


def other_stage_split(meta: dict, config: Config, layout: Layout,
                      boundaries: list[int] | None) -> list[int] | None:
    """The pipeline split a checkpoint at this tp x pp was saved with, when it differs from
    `boundaries` (this run's); None when it is the same or pp = 1. Checkpoints made before
    stages were balanced by FLOPs record none: theirs is DeepSpeed's parameter balance."""
    if layout.pp == 1 or meta["layout"].get("pp") != layout.pp:
        return None
    saved = meta.get("stage_boundaries") or parameter_balanced_boundaries(config, layout.pp)
    return None if list(saved) == list(boundaries) else list(saved)


def check_layout(folder: Path, meta: dict, layout: Layout, config: Config | None = None,
                 boundaries: list[int] | None = None) -> str:
    """How a checkpoint loads at this run's layout, decided before the model is built:
    'same' (everything, RNG states included), 'deepspeed' (DeepSpeed's own load: only dp
    changed and no ZeRO partitions), or 'full' (full tensors read from the saved files and cut
    for this layout, optimizer state included; the path of portable checkpoints).

    With `config` and this run's pipeline `boundaries`, the same tp x pp saved with another
    stage split also loads 'full': each stage's optimizer files hold the layers of the saved
    split (layers are named by their global index in every file)."""
    saved, tp, pp = meta["layout"], layout.tp, layout.pp
    if saved == layout.sizes():
        saved_stages = other_stage_split(meta, config, layout, boundaries) if config else None
        if saved_stages is None:
            return "same"
        if comm.rank() == 0:
            print(f"{folder}: saved with pipeline stages {saved_stages}, this run splits them "
                  f"as {boundaries}: loading full tensors", flush=True)
        return "full"
    if is_portable(meta):
        return "full"
    zero = int(meta["config"].get("parallel", {}).get("zero_stage", 0))
    if zero > 0:
        return "full"
    if (saved.get("tp"), saved.get("pp")) == (tp, pp):
        return "deepspeed"
    raise CheckpointError(
        f"{folder} was saved at tp={saved.get('tp')} pp={saved.get('pp')} with "
        f"parallel.zero_stage=0, whose optimizer files cannot be re-cut; this run is tp={tp} "
        f"pp={pp}. Resume at the saved tp and pp, or keep the weights only: "
        f"{reshard_command(folder, tp, pp)}")


# What shapes the LR schedule (training/optim.py: lr_lambda), as (section, key).
SCHEDULE_KEYS = (("train", "steps"), ("optim", "lr"), ("optim", "warmup_steps"),
                 ("optim", "decay"), ("optim", "decay_start_step"), ("optim", "min_lr"))


def data_position(consumed_samples: int, global_batch_size: int) -> int:
    """Where the data resumes: the first multiple of the global batch at or after
    `consumed_samples` (the stream is indexed by samples; see data/sampler.py)."""
    return -(-consumed_samples // global_batch_size) * global_batch_size


def resume_notices(folder: Path, meta: dict, config: Config) -> list[str]:
    """What changes when `config` resumes the checkpoint (`meta`) with another global batch
    size or another LR schedule: one line each, for rank 0 to print. A weights-only checkpoint
    (a conversion) starts from step 0 with a fresh schedule: nothing to say."""
    if meta.get("weights_only"):
        return []
    notices, saved = [], meta["config"]
    step, consumed = int(meta["step"]), int(meta["consumed_samples"])
    old_batch, batch = saved["train"]["global_batch_size"], config.train.global_batch_size
    if old_batch != batch:
        position = data_position(consumed, batch)
        where = (f"the data continues at sample {consumed}" if position == consumed else
                 f"{consumed} is not a multiple of {batch}: the data continues at sample "
                 f"{position}, skipping {position - consumed} samples")
        notices.append(
            f"{folder}: train.global_batch_size {old_batch} -> {batch}; {consumed} samples "
            f"consumed in {step} steps, {where}. Steps continue from {step} with {batch} "
            f"samples each; the data schedules (data.phase_starts, data.language_start) count "
            f"a step as {batch} samples from the start")
    changed = [(section, key, saved.get(section, {}).get(key), getattr(getattr(config, section),
                                                                        key))
               for section, key in SCHEDULE_KEYS]
    changed = [c for c in changed if c[2] is not None and c[2] != c[3]]
    if changed:
        before = copy.deepcopy(config)
        for section, key, value, _ in changed:
            setattr(getattr(before, section), key, value)
        base = before.optim.lr  # the restored scheduler keeps the checkpoint's base rate
        # The optimizer's restored LR is the checkpoint's for one more step; the scheduler's
        # next step applies the new shape.
        lr_then = base * lr_lambda(before)(step)
        lr_next = base * lr_lambda(config)(step + 1)
        what = ", ".join(f"{s}.{k} {a} -> {b}" for s, k, a, b in changed)
        notices.append(
            f"{folder}: the LR schedule changes shape ({what}); step {step + 1} trains at the "
            f"checkpoint's LR {lr_then:.4g}, step {step + 2} at {lr_next:.4g} and the "
            "following steps on the new schedule"
            + (f"; optim.lr is not applied on resume: the restored scheduler keeps the "
               f"checkpoint's base rate {base:g}" if before.optim.lr != config.optim.lr else ""))
    return notices


def load_checkpoint(engine, folder: Path, how: str = "same") -> ResumeState:
    """Restore model, optimizer, LR schedule, loss scaler and (same layout) RNG states.

    The folder is checked against its manifest before any file is opened. `how`: what
    `check_layout` decided ('same', 'deepspeed' or 'full'). A portable checkpoint (written by
    `convert from-hf` or `reshard`) and, with 'full', one of ours saved at another layout load
    as full tensors (via `CheckpointReader`): the weights, the optimizer state unless weights
    only, no RNG states.
    """
    folder = protocol.check_step_dir(folder)
    error = None
    try:  # the ranks split the hashing; all agree before anything is unpickled
        protocol.verify(folder, share=(comm.rank(), comm.world_size()))
    except CheckpointError as err:
        error = err
    (failed,) = comm.all_reduce_values([0.0 if error is None else 1.0])
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{folder}: a file differs from its manifest.json (another "
                              "rank's error names it)")
    meta = read_meta(folder)
    if is_portable(meta):
        load_portable(engine, folder, meta)
        return ResumeState(step=int(meta["step"]), consumed_samples=int(meta["consumed_samples"]),
                           path=folder)
    if how == "full":
        with CheckpointReader(folder, verify_files=False) as reader:
            load_full_tensors(engine, reader, {**meta, "weights_only": False,
                                               "optimizer": reader.optimizer_meta()})
        return ResumeState(step=int(meta["step"]), consumed_samples=int(meta["consumed_samples"]),
                           path=folder)
    _guard(engine)
    path, client = engine.load_checkpoint(str(folder.parent), tag=folder.name,
                                          load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if path is None:
        raise CheckpointError(f"{folder}: DeepSpeed found no model states to load")
    rng_file = folder / "rng" / f"rank_{comm.rank():05d}.pt"
    if how == "same" and rng_file.exists():
        tp_random.set_rng_states(torch_load_weights(rng_file, mmap=False))
    return ResumeState(step=client["step"], consumed_samples=client["consumed_samples"],
                       path=folder)

