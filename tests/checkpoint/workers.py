"""Trainer runs for the integrity tests (module-level: spawned gloo workers import them)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from tests.convert.workers import GLOBAL_BATCH, MICRO, overrides
from tests.training.helpers import micro_batches


class Evil:
    """A pickle that carries code: unpickling it creates the file `marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _copy(folder: Path, root: Path, name: str) -> Path:
    """A copy of step folder `folder` in its own save_dir `root/name`."""
    target = root / name / folder.name
    shutil.copytree(folder, target)
    return target


def _error(fn) -> str:
    from megatron_rembert.errors import UserError

    try:
        fn()
    except (UserError, OSError) as err:  # Checkpoint/DivergenceError; OSError: a failed write
        return str(err)
    return "no error"


# The optimizer's file of a one-rank run on the production path (checkpoint/optimizer_shards.py)
OPTIM_FILE = "optim_tp00_pp000_dp000.safetensors"
RNG_FILE = "rng/rank_00000.pt"


def integrity_worker(rank, world_size, root: str) -> dict:
    """Train one step at tp = pp = dp = 1 (ZeRO-1), save it, then load damaged copies."""
    import deepspeed

    from megatron_rembert.checkpoint.step_folder import StepFolder, write_manifest
    from megatron_rembert.parallel import state
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training import checkpoint as ckpt
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.plan import RunPlan

    root = Path(root)
    deepspeed.init_distributed(dist_backend="gloo")
    config = build_config({"model": {"preset": "tiny"}}, overrides(1, 1))
    plan = RunPlan.build(config, world_size)
    layout = plan.layout
    state.initialize_model_parallel(layout)
    trainer = Trainer(config, plan, torch.device("cpu"))
    trainer.train_step(micro_batches(0, GLOBAL_BATCH, MICRO, 0, 1, config.model.vocab_size))
    meta = {"config": config.to_dict(), "tokenizer_sha256": None,
            "layout": {"tp": 1, "pp": 1, "dp": 1}}
    save_dir = root / "run"
    good = ckpt.save_checkpoint(trainer.engine, save_dir, 1, GLOBAL_BATCH, meta, keep_last=5)

    def load(folder):
        return lambda: ckpt.load_checkpoint(trainer.engine, StepFolder.open(folder),
                                            how="same")

    out = {"good": str(good)}
    folder = _copy(good, root, "new_evil_optim")
    torch.save({"payload": Evil(str(root / "new_evil_optim.ran"))}, folder / OPTIM_FILE)
    out["new_evil_optim"] = _error(load(folder))
    folder = _copy(good, root, "new_evil_rng")  # our folder's one pickle: the RNG states
    torch.save({"payload": Evil(str(root / "new_evil_rng.ran"))}, folder / RNG_FILE)
    write_manifest(folder, {})  # the manifest made to agree with it
    out["new_evil_rng"] = _error(load(folder))

    # A checkpoint of DeepSpeed's files (what every path wrote before 2026-12-07, here made by
    # DeepSpeed's own save), holding a pickle that carries code: refused by its meta.json,
    # before any of its files is opened
    legacy = root / "legacy" / "step_00000001"
    trainer.engine.save_checkpoint(str(legacy.parent), tag=legacy.name, save_latest=False)
    torch.save({"payload": Evil(str(root / "legacy.ran"))},
               legacy / "mp_rank_00_model_states.pt")
    (legacy / "meta.json").write_text(json.dumps({**meta, "step": 1,
                                                  "consumed_samples": GLOBAL_BATCH}))
    write_manifest(legacy, {})
    (legacy / "complete").write_text("")
    out["legacy"] = _error(lambda: ckpt.load_checkpoint(trainer.engine,
                                                        StepFolder.open(legacy), how="same"))

    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):  # what torch's stream writer raises for ENOSPC
        if isinstance(f, (str, os.PathLike)):
            raise RuntimeError("[enforce fail at inline_container.cc:626] . "
                               "PytorchStreamWriter failed writing file data/0: file write "
                               "failed")
        return real_save(obj, f, *args, **kwargs)

    torch.save = full_disk
    out["full_disk"] = _error(lambda: ckpt.save_checkpoint(
        trainer.engine, save_dir, 2, 2 * GLOBAL_BATCH, meta, keep_last=5))
    torch.save = real_save
    trainer.wait_for_weights()
    with torch.no_grad():
        next(trainer.engine.module.parameters())[0] = float("inf")  # what optim.lr=inf does
    out["non_finite"] = _error(lambda: ckpt.save_checkpoint(
        trainer.engine, save_dir, 3, 3 * GLOBAL_BATCH, meta, keep_last=5))
    return out


def precision_change_worker(rank, world_size, root: str, saved: str, resumed: str) -> dict:
    """Train 2 steps in precision `saved` at dp `world_size`, save; a trainer in precision
    `resumed` (same layout) loads that folder without a conversion: its masters, moments and
    weights against the saving trainer's."""
    import deepspeed

    from megatron_rembert.checkpoint import resume
    from megatron_rembert.checkpoint.step_folder import StepFolder
    from megatron_rembert.parallel import state
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training import checkpoint as ckpt
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.plan import RunPlan
    from tests.training.production import _masters_and_momentum

    deepspeed.init_distributed(dist_backend="gloo")

    def trainer(precision: str):
        config = build_config({"model": {"preset": "tiny"}}, overrides(1, 1) + [
            f"train.precision={precision}"])
        plan = RunPlan.build(config, world_size, rank)
        state.initialize_model_parallel(plan.layout)
        return Trainer(config, plan, torch.device("cpu")), config, plan

    first, config, plan = trainer(saved)
    for step in range(2):
        first.train_step(micro_batches(step, GLOBAL_BATCH, MICRO, plan.layout.dp_rank,
                                       plan.layout.dp, config.model.vocab_size))
    meta = {"config": config.to_dict(), "tokenizer_sha256": None,
            "layout": plan.layout.sizes()}
    folder = ckpt.save_checkpoint(first.engine, Path(root) / "run", 2, 2 * GLOBAL_BATCH, meta,
                                  keep_last=2)
    masters, moments = _masters_and_momentum(first)
    del first
    second, _, plan2 = trainer(resumed)
    step_folder = StepFolder.open(folder)
    how = resume.check_layout(step_folder, plan2.layout)
    ckpt.load_checkpoint(second.engine, step_folder, how)
    second.wait_for_weights()
    masters2, moments2 = _masters_and_momentum(second)
    weights = {n: p.detach() for n, p in second.engine.module.named_parameters()}
    return {"how": how, "dtypes": sorted({str(p.dtype) for p in weights.values()}),
            "masters": all(torch.equal(masters[n], masters2[n]) for n in masters),
            "moments": all(torch.equal(moments[n], moments2[n]) for n in moments),
            "weights": all(torch.equal(weights[n], masters[n].to(weights[n].dtype))
                           for n in masters),
            "lr": second.scheduler.get_last_lr() == [g["lr"] for g in
                                                     second.optimizer.param_groups],
            "names": len(masters) == len(weights)}
