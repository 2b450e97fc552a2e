"""Trainer runs for the conversion tests (module-level: spawned gloo workers import them)."""

from __future__ import annotations

import torch

from tests.training.helpers import SEQ, micro_batches, split_micro

GLOBAL_BATCH, MICRO = 8, 2


def overrides(tp: int, pp: int, steps: int = 6) -> list[str]:
    return [f"parallel.tp={tp}", f"parallel.pp={pp}",
            f"train.global_batch_size={GLOBAL_BATCH}", f"train.micro_batch_size={MICRO}",
            "train.precision=fp32", f"train.steps={steps}", "optim.warmup_steps=2",
            "optim.lr=3e-3", "optim.clip_grad=0.5", f"data.seq_length={SEQ}"]


def train_worker(rank, world_size, model: dict, over: list[str], load: str | None,
                 first_step: int, steps: int, save: tuple[str, int] | None) -> list[float]:
    """Build the Trainer, optionally load `load` (a step folder), train `steps` global batches
    starting at `first_step`, saving after global step `save[1]` into `save[0]`."""
    import deepspeed

    from megatron_rembert.checkpoint.step_folder import StepFolder
    from megatron_rembert.parallel import state
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training import checkpoint as ckpt
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.plan import RunPlan

    deepspeed.init_distributed(dist_backend="gloo")
    config = build_config({"model": model}, over)
    plan = RunPlan.build(config, world_size, rank)
    layout = plan.layout
    s = state.initialize_model_parallel(layout)
    trainer = Trainer(config, plan, torch.device("cpu"))
    if load:
        resumed = ckpt.load_checkpoint(trainer.engine, StepFolder.open(load), how="full")
        assert resumed.step == first_step
    losses = []
    for step in range(first_step, first_step + steps):
        batches = micro_batches(step, GLOBAL_BATCH, MICRO, s.dp_rank, layout.dp,
                                config.model.vocab_size)
        losses.append(trainer.train_step(batches).loss)
        if save and step + 1 == save[1]:
            meta = {"config": config.to_dict(), "tokenizer_sha256": None,
                    "layout": layout.sizes()}
            ckpt.save_checkpoint(trainer.engine, save[0], step + 1,
                                 (step + 1) * GLOBAL_BATCH, meta, keep_last=5)
    return losses


def eval_worker(rank, world_size, model: dict, over: list[str], load: str, batch: dict
                ) -> float:
    """Mean MLM loss of `batch` (one global batch) after loading `load`."""
    import deepspeed

    from megatron_rembert.checkpoint.step_folder import StepFolder
    from megatron_rembert.parallel import state
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training import checkpoint as ckpt
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.plan import RunPlan

    deepspeed.init_distributed(dist_backend="gloo")
    config = build_config({"model": model}, over)
    plan = RunPlan.build(config, world_size, rank)
    layout = plan.layout
    state.initialize_model_parallel(layout)
    trainer = Trainer(config, plan, torch.device("cpu"))
    ckpt.load_checkpoint(trainer.engine, StepFolder.open(load), how="full")
    micro = split_micro(batch, MICRO)
    return trainer.eval_step(micro)[0]
