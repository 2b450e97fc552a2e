"""Checkpoints that a crash, a signal or a full disk never corrupt.

Layout of `train.save_dir`:
    step_00001000/          the engine's per-rank files (DeepSpeed), written by every rank
        rng/rank_00003.pt   each rank's RNG states (dropout streams)
        meta.json           config, layout, step, consumed samples, tokenizer hash
        complete            written last, after every rank has finished
    latest                  name of the newest complete folder, replaced atomically

A kill at any moment leaves `latest` pointing at the previous complete checkpoint; folders
without `complete` are never loaded and are removed by the next successful save.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rembert.data.common import atomic_write, atomic_write_json
from megatron_rembert.parallel import comm
from megatron_rembert.parallel import random as tp_random

COMPLETE = "complete"
LATEST = "latest"


class CheckpointError(RuntimeError):
    pass


@dataclass
class ResumeState:
    step: int
    consumed_samples: int
    path: Path


def _rank() -> int:
    return comm.rank()


def _barrier() -> None:
    comm.barrier()


def step_tag(step: int) -> str:
    return f"step_{step:08d}"


def save_checkpoint(engine, save_dir: str | Path, step: int, consumed_samples: int, meta: dict,
                    keep_last: int) -> Path:
    """Every rank calls this; returns the new folder once it is complete and `latest`."""
    save_dir = Path(save_dir)
    tag = step_tag(step)
    folder = save_dir / tag
    if _rank() == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        if folder.exists():  # a partial folder left by an earlier kill at this very step
            shutil.rmtree(folder)
    _barrier()
    client = {"step": step, "consumed_samples": consumed_samples}
    error = None
    try:
        engine.save_checkpoint(str(save_dir), tag=tag, client_state=client, save_latest=False)
        rng_dir = folder / "rng"
        rng_dir.mkdir(parents=True, exist_ok=True)
        torch.save(tp_random.get_rng_states(), rng_dir / f"rank_{_rank():05d}.pt")
    except OSError as err:  # a full disk, a lost mount: fail on every rank, keep `latest`
        error = err
    # Also the barrier: every rank's files are on disk.
    (failed,) = comm.all_reduce_values([0.0 if error is None else 1.0])
    if failed:
        raise CheckpointError(f"saving {folder} failed on {int(failed)} rank(s)"
                              + (f": {error}" if error else "")
                              + f"; {save_dir / LATEST} still names the last good checkpoint")
    if _rank() == 0:
        meta = {**meta, "step": step, "consumed_samples": consumed_samples}
        atomic_write_json(folder / "meta.json", meta)
        atomic_write(folder / COMPLETE, lambda f: None)
        atomic_write(save_dir / LATEST, lambda f: f.write(tag + "\n"), binary=False)
        _prune(save_dir, keep_last, current=tag)
    _barrier()
    return folder


def _prune(save_dir: Path, keep_last: int, current: str) -> None:
    folders = sorted(p for p in save_dir.glob("step_*") if p.is_dir())
    complete = [p for p in folders if (p / COMPLETE).exists()]
    for p in folders:
        if not (p / COMPLETE).exists() and p.name != current:
            shutil.rmtree(p, ignore_errors=True)  # debris of a killed save
    for p in complete[: max(0, len(complete) - max(1, keep_last))]:
        shutil.rmtree(p, ignore_errors=True)


def find_latest(save_dir: str | Path) -> Path | None:
    """The folder `latest` names, checked for completeness; None when there is none yet."""
    save_dir = Path(save_dir)
    pointer = save_dir / LATEST
    if not pointer.exists():
        return None
    folder = save_dir / pointer.read_text().strip()
    if not (folder / COMPLETE).exists() or not (folder / "meta.json").exists():
        raise CheckpointError(
            f"{pointer} names {folder}, which is not a complete checkpoint (no '{COMPLETE}' "
            "marker or meta.json); point 'latest' at a complete step_* folder or remove it")
    return folder


def read_meta(folder: Path) -> dict:
    try:
        return json.loads((folder / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{folder / 'meta.json'}: unreadable ({err})") from err


def load_checkpoint(engine, folder: Path, same_layout: bool) -> ResumeState:
    """Restore model, optimizer, LR schedule, loss scaler and (same layout) RNG states.

    A portable checkpoint (written by `python -m megatron_rembert.convert from-hf` or
    `reshard`; see training/portable.py) loads at any layout: weights, and unless
    `weights_only` the optimizer state; RNG states are not carried.
    """
    meta = read_meta(folder)
    if meta.get("format", "").startswith("megatron-rembert-portable"):
        from megatron_rembert.training.portable import load_portable  # imports this module

        load_portable(engine, folder, meta)
        return ResumeState(step=int(meta["step"]), consumed_samples=int(meta["consumed_samples"]),
                           path=folder)
    path, client = engine.load_checkpoint(str(folder.parent), tag=folder.name,
                                          load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if path is None:
        raise CheckpointError(f"{folder}: DeepSpeed found no model states to load")
    rng_file = folder / "rng" / f"rank_{_rank():05d}.pt"
    if same_layout and rng_file.exists():
        tp_random.set_rng_states(torch.load(rng_file, weights_only=True))
    return ResumeState(step=client["step"], consumed_samples=client["consumed_samples"],
                       path=folder)
