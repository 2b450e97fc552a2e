"""Saving the trainer's state into, and loading it from, a step folder.

The folder protocol (`complete`, `latest`, meta.json, manifest.json, pruning) is
megatron_rembert/checkpoint/step_folder.py, and what a resume decides before the model is built
(how a checkpoint loads at this layout, what changes) is checkpoint/resume.py; this module is
what needs the engine. Each step folder holds the optimizer's files plus `rng/rank_XXXXX.pt`
(each rank's dropout RNG states).

Those files are ours only: every rank writes its optimizer fragments (fp32 masters, moments)
into `optim_tp*_pp*_dp*.safetensors` (checkpoint/optimizer_shards.py; meta.json says
`optimizer_format`, `deepspeed_files: false` and holds the LR schedule and, in fp16, the loss
scaler's state). The masters are the weights of record, so no module file is written; a resume
at any TP x PP x DP and in any precision reads them, and the all-gather that follows gives
every rank its weights. Checkpoints of version 0.2.0's DeepSpeed optimizers (fp16, ZeRO-2, fp32
without ZeRO) are the same files and resume the same way, their fp16 scaler with them.
`engine.save_checkpoint` and `engine.load_checkpoint` are called on no path; a folder of
DeepSpeed's files (written by version 0.1.0) is refused before the model is built
(checkpoint/reader.py, `check_format`). The RNG files are the one pickle, read with
`torch.load(weights_only=True)`: a pickle that carries code is refused, never run.
"""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import shutil
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rembert.checkpoint import CheckpointError, optimizer_shards
from megatron_rembert.checkpoint.files import torch_load_weights
from megatron_rembert.checkpoint.portable import PortableReader, is_portable
from megatron_rembert.checkpoint.reader import CheckpointReader, check_format
from megatron_rembert.checkpoint.specs import ParamSpec
from megatron_rembert.checkpoint.step_folder import (
    COMPLETE,
    DEEPSPEED_FILES,
    LATEST,
    StepFolder,
    clear_save_paths,
    commit,
    step_tag,
    verify,
)
from megatron_rembert.fs import (
    WriteError,
    atomic_write_json,
    sha256_file,
    write_errors,
    write_failure,
)
from megatron_rembert.parallel import comm, state
from megatron_rembert.parallel import random as tp_random
from megatron_rembert.training.divergence import DivergenceError, check_weights
from megatron_rembert.training.full_tensors import (
    load_into_fragments,
    local_parameters,
    restore_schedule,
)

RECORDS = ".hashes"  # per-rank hashes of one save, merged into manifest.json by rank 0
LOSS_SCALER = "loss_scaler"  # meta.json: fp16's loss scaler state (training/loss_scale.py)


@dataclass
class ResumeState:
    step: int
    consumed_samples: int


class SaveState:
    """One rank's state of the saves of one engine: this save's files, their hashes, the
    background write in flight, the gloo group its writer agrees over."""

    def __init__(self):
        self.records: dict[str, dict] = {}  # absolute path -> {"size", "sha256"}
        self.files: list[tuple[str, object]] = []  # (path, RNG states) of this save, to write
        self.shards: optimizer_shards.Collected | None = None  # this rank's, to write
        self.pending: PendingSave | None = None  # the background save in flight
        self.host_group = None  # the gloo group its writer agrees over (made at first use)
        # The first failed write of this save (a full disk, a lost mount): the rank goes on to
        # the save's end, where every rank agrees on the outcome.
        self.failed: WriteError | None = None

    def start_save(self) -> None:
        self.records.clear()
        self.release()
        self.failed = None

    def release(self) -> None:
        """Drops this save's states (and their host copies) once they are written."""
        self.files = []
        self.shards = None

    def write(self, state_dict, path: str) -> None:
        # torch.save writes a path from C++ several times faster than through a Python file
        # object, so the file is hashed right after, from the page cache, by the rank that
        # wrote it (bench/checkpoint_hash.py).
        if self.failed is not None:  # this save is lost already; the others go on to its end
            return
        try:
            with write_errors(path):  # a full disk: torch raises a RuntimeError
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                torch.save(state_dict, path)
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)  # on disk before `complete` names the folder good
                finally:
                    os.close(fd)
        except WriteError as err:
            self.failed = err
            return
        self.records[str(Path(path).resolve())] = {"size": os.path.getsize(path),
                                                   "sha256": sha256_file(path)}


# each engine's SaveState, kept here rather than on DeepSpeed's object
_SAVES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _save_state(engine) -> SaveState:
    if engine not in _SAVES:
        _SAVES[engine] = SaveState()
    return _SAVES[engine]


class PendingSave:
    """A save whose files are written in a background thread. `wait()` (every rank) returns
    the folder once it is complete and `latest`, or raises what the save raised."""

    def __init__(self, folder: Path, work: Callable[[], None]):
        self.folder = folder
        self.error: BaseException | None = None

        def run() -> None:
            try:
                work()
            except BaseException as err:  # handed to the training thread by wait()
                self.error = err

        # A daemon: a crash of the training thread does not wait for the write; the folder
        # then has no `complete` and `latest` still names the previous checkpoint.
        self.thread = threading.Thread(target=run, name=f"save {folder.name}", daemon=True)
        self.thread.start()

    def wait(self) -> Path:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.folder


def wait_for_save(engine) -> None:
    """Every rank: the background save in flight, if any, complete and `latest` (or its error
    raised). A save waits for the previous one itself; a stop and the end of a run call this."""
    guard = _save_state(engine)
    pending, guard.pending = guard.pending, None
    if pending is not None:
        pending.wait()


def save_checkpoint(engine, save_dir: str | Path, step: int, consumed_samples: int, meta: dict,
                    keep_last: int, max_weight_abs: float = math.inf,
                    background: bool = False) -> Path | PendingSave:
    """Every rank calls this; returns the new folder once it is complete and `latest`, or with
    `background`, a PendingSave as soon as the state is copied (its `wait()` gives the folder).

    Refuses (divergence.DivergenceError, no file written) unless every weight is finite and
    within +-`max_weight_abs` (train.max_weight_abs): in the foreground before anything is
    collected, in the background on the host copy of the weights before the writes (the
    error comes from `wait()`; the step blocks only for the copy). A failed write (full disk,
    read-only file system, lost mount: whatever exception the writer raised, see
    fs.write_errors) raises the same `WriteError` on every rank (from `wait()` in the
    background). Either way `latest` keeps naming the last good checkpoint.
    """
    wait_for_save(engine)
    save_dir = Path(save_dir)
    folder = save_dir / step_tag(step)
    # our files only: the optimizer shards (the masters are the weights of record), the LR
    # schedule and (fp16) the loss scaler in meta.json
    schedule = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    meta = {**meta, "optimizer_format": optimizer_shards.FORMAT, DEEPSPEED_FILES: False,
            "lr_scheduler": schedule}
    if engine.optimizer.loss_scaler is not None:
        meta[LOSS_SCALER] = engine.optimizer.loss_scaler.state_dict()
    engine.optimizer.wait_for_weights()  # the step left their all-gather to the next one
    if not background:
        check_weights(engine.module.parameters(), step, max_weight_abs, save_dir)
    if comm.rank() == 0:  # a partial folder left by a kill at this step; never through a link
        clear_save_paths(save_dir, folder)
    comm.barrier()
    guard = _save_state(engine)
    guard.start_save()
    if background and guard.host_group is None:
        guard.host_group = comm.new_host_group()
    host_group = guard.host_group if background else None

    def failure(error: BaseException | None, ranks: int) -> WriteError:
        # A full disk, a read-only file system, a lost mount: said the same way on every rank
        # (a rank whose own writes worked says the others failed), one line each.
        reason = f" ({write_failure(error)})" if isinstance(error, OSError) else ""
        return WriteError(getattr(error, "errno", None) or errno.EIO,
                          f"saving failed on {ranks} rank(s){reason}; {save_dir / LATEST} "
                          "still names the last good checkpoint", str(folder))

    def removing_a_partial_folder(block: Callable[[], None]) -> None:
        try:
            block()
        except (CheckpointError, OSError, DivergenceError):
            if comm.rank() == 0 and not (folder / COMPLETE).exists():
                shutil.rmtree(folder, ignore_errors=True)  # the partial folder of a failed save
            raise

    def collect() -> None:  # this rank's optimizer shard (copied in the background case),
        # RNG states
        guard.shards = optimizer_shards.collect(engine.optimizer, _specs(engine, meta),
                                                copy=background, **_where())
        rng = tp_random.get_rng_states()
        guard.files.append((str(folder / "rng" / f"rank_{comm.rank():05d}.pt"),
                            copy.deepcopy(rng) if background else rng))

    def write_and_commit() -> None:
        if background:  # the host copies of the weights, alike on every rank after the MAX
            check_weights(weights, step, max_weight_abs, save_dir, host_group)
        with comm.agree_or_raise(OSError, failure, host_group):
            _write_files(guard, folder)
        with comm.agree_or_raise(OSError, failure, host_group):
            if comm.rank() == 0:
                records = {}  # a part not seen here only means write_manifest hashes those again
                for part in sorted((folder / RECORDS).glob("rank_*.json")):
                    records.update(json.loads(part.read_text()))
                shutil.rmtree(folder / RECORDS)
                commit(save_dir, folder,
                       {**meta, "step": step, "consumed_samples": consumed_samples},
                       records, keep_last)

    def written() -> None:
        try:
            removing_a_partial_folder(write_and_commit)
        finally:
            guard.release()

    removing_a_partial_folder(collect)
    if background:
        # The weights as saved: the host copies of this rank's masters
        weights = [t for key, t in guard.shards.items if key.startswith("master/")]
        guard.pending = PendingSave(folder, written)
        return guard.pending
    written()
    return folder


def _write_files(guard: SaveState, folder: Path) -> None:
    """This rank's files of the step folder (its RNG states, its optimizer shard), then its
    hashes."""
    for path, saved in guard.files:
        guard.write(saved, path)
    if guard.failed is not None:
        raise guard.failed
    if guard.shards is not None:
        with write_errors(folder / guard.shards.name):
            path, record = optimizer_shards.write(guard.shards, folder)
        guard.records[str(path.resolve())] = record
    # Each rank's hashes, as paths relative to the folder (nodes may mount it elsewhere),
    # go into a small file of their own; rank 0 merges them into the manifest.
    root = folder.resolve()
    atomic_write_json(folder / RECORDS / f"rank_{comm.rank():05d}.json",
                      {str(Path(p).relative_to(root)): r
                       for p, r in guard.records.items() if Path(p).is_relative_to(root)})


def _specs(engine, meta: dict) -> dict[int, ParamSpec]:
    """id(parameter) -> its spec (global names) for this rank's parameters."""
    layers = int(meta["config"]["model"]["num_hidden_layers"])
    return {id(p): ParamSpec.of(n, p, layers) for n, p in local_parameters(engine.module)}


def _where() -> dict:
    """This rank's place among the model-parallel ranks, as optimizer_shards names its file."""
    parallel = state.get_state()
    return {"tp": parallel.tp, "tp_rank": parallel.tp_rank, "pp": parallel.layout.pp,
            "pp_rank": parallel.pp_rank}


def _load(engine, step: StepFolder, how: str) -> None:
    """Our distributed optimizer (any layout, any precision): from the trainer's shard files,
    or from a portable checkpoint's full tensors; fp16's loss scaler where the checkpoint
    holds its state."""
    folder, meta = step.path, step.meta
    if is_portable(meta):
        with PortableReader(folder) as reader:
            load_into_fragments(engine, reader, meta)
        return
    where = _where()
    optimizer_shards.load(engine.optimizer, _specs(engine, meta), folder, tp=where["tp"],
                          tp_rank=where["tp_rank"])
    with CheckpointReader(step, verify_files=False) as reader:
        restore_schedule(engine, meta, reader.optimizer_meta())
    scaler = engine.optimizer.loss_scaler
    if scaler is not None and meta.get(LOSS_SCALER):
        scaler.load_state_dict(meta[LOSS_SCALER])
    _load_rng(folder, how)


def _load_rng(folder: Path, how: str) -> None:
    """This rank's dropout RNG states, when it resumes at the layout that saved them."""
    rng_file = folder / "rng" / f"rank_{comm.rank():05d}.pt"
    if how == "same" and rng_file.exists():
        tp_random.set_rng_states(torch_load_weights(rng_file, mmap=False))


def load_checkpoint(engine, step: StepFolder, how: str = "same") -> ResumeState:
    """Restore model, optimizer, LR schedule, loss scaler and (same layout) RNG states.

    The folder is checked against its manifest before any file is opened. `how`: what
    `checkpoint.resume.check_layout` decided ('same' or 'full'). Our distributed optimizer
    reads its fragments of the shard files at any layout. A portable checkpoint (written by
    `convert from-hf` or `reshard`) loads the same way: the weights, the optimizer state unless
    weights only, no RNG states.
    """
    folder, meta = step.path, step.meta
    check_format(step)
    with comm.agree_or_raise(CheckpointError, lambda error, ranks: error or CheckpointError(
            f"{folder}: a file differs from its manifest.json (another rank's error names it)")):
        verify(folder, share=(comm.rank(), comm.world_size()))  # the ranks split the hashing
    resumed = ResumeState(step=int(meta["step"]), consumed_samples=int(meta["consumed_samples"]))
    _load(engine, step, how)
    return resumed
