"""The run's save folder at start-up: what every checkpoint of the run records (run_meta), the
folder's lock (one run per folder), and the resume decision (which checkpoint, and how it
loads at this run's layout), all before the model is built."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron_rembert.checkpoint import CheckpointError, resume
from megatron_rembert.checkpoint.lock import SaveDirLock
from megatron_rembert.checkpoint.step_folder import (
    StepFolder,
    find_latest,
    roll_back,
    unexpected_entries,
)
from megatron_rembert.fs import sha256_file
from megatron_rembert.launch_env import LaunchEnv
from megatron_rembert.parallel import comm
from megatron_rembert.parallel.layout import Layout
from megatron_rembert.run_config.schema import Config
from megatron_rembert.training.optim import lr_lambda
from megatron_rembert.training.plan import RunPlan


def run_meta(config: Config, sha: str | None, plan: RunPlan) -> dict:
    """What every checkpoint of this run records beside its step. `config`: the settings as
    given (parallel.* included, to reproduce the run); `layout` and `stage_boundaries`: what
    the run resolved them to (how the files are cut: what a resume and the readers compare)."""
    return {"config": config.to_dict(), "tokenizer_sha256": sha,
            "dataset_sha256": sha256_file(Path(config.data.path, "manifest.json")),
            "layout": plan.layout.sizes(), "stage_boundaries": plan.stage_boundaries}


@contextmanager
def save_dir_locked(config: Config, launch: LaunchEnv) -> Iterator[None]:
    """Rank 0 locks train.save_dir (which also proves it writable) before any heavy work;
    every rank learns whether that worked. The lock records the SLURM job of `launch`."""
    lock = SaveDirLock(config.train.save_dir, job=launch.slurm_job_id)
    with comm.agree_or_raise(CheckpointError, lambda error, ranks: error or CheckpointError(
            f"train.save_dir={config.train.save_dir}: rank 0 could not lock it (its error says "
            "why)")):
        if comm.rank() == 0:
            lock.acquire()
    try:
        yield
    finally:
        lock.release()


def find_resume(config: Config, meta_now: dict, layout: Layout
                 ) -> tuple[StepFolder | None, str]:
    """The checkpoint to resume from (after a roll-back to train.resume_from) and how it loads
    at this run's layout (checkpoint.resume.check_resume), checked before the model is built."""
    save_dir = Path(config.train.save_dir)
    if config.train.resume_from:
        if comm.rank() == 0:
            moved = roll_back(save_dir, Path(config.train.resume_from))
            if moved is None:
                print(f"train.resume_from={config.train.resume_from}: rolled back before; "
                      "resuming from 'latest'", flush=True)
            elif moved:
                print(f"rolled back to {config.train.resume_from}: moved "
                      f"{', '.join(p.name for p in moved)} into {moved[0].parent}", flush=True)
        comm.barrier()
    if comm.rank() == 0 and (stray := unexpected_entries(save_dir)):
        print(f"{save_dir}: ignored, not checkpoints of this run: {', '.join(stray)}",
              flush=True)  # once, at start-up; saving and pruning leave them alone
    latest = find_latest(save_dir)
    if latest is None:
        return None, "same"
    how, notices = resume.check_resume(latest, config, meta_now, layout, lr_lambda)
    if comm.rank() == 0:  # another global batch size, LR schedule or stage split: said once
        for notice in notices:
            print(notice, flush=True)
    return latest, how
