"""fp32 with ZeRO-1 (ds_configs/cpu_fp32.json, what configs/demo.yaml and tiny.yaml train with)
on training/main_grads.py's gradient path, against DeepSpeed's own path on the same batches:
- the same weights and Adam moments after three steps at dp = 2 with accumulation (the two
  paths sum the same fp32 gradients in a different order: 1.3e-6 measured, 1e-5 allowed);
- DeepSpeed's gradient hooks are gone, the master partition is this rank's slice of the flat
  weights (no second fp32 copy of the model), and a rank's optimizer state holds its own
  partition only, not the whole flat buffer the slice views (torch.save would write it all).
train.py's loop on this path against plain torch: tests/training/test_production_path.py.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.helpers import micro_batches

ROOT = Path(__file__).resolve().parents[2]
GLOBAL, MICRO = 8, 2
# Softmax ignores a constant added to a row of scores: the key bias's gradient is rounding noise
# and its Adam steps follow it (tests/training/test_production_path.py).
NO_GRADIENT = "key.bias"


def _trainer(world_size: int, rank: int):
    from megatron_rembert.parallel import state
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.plan import RunPlan

    config = build_config({"model": {"preset": "tiny"}}, [
        "train.precision=fp32", "parallel.zero_stage=1",
        f"parallel.ds_config={ROOT / 'ds_configs' / 'cpu_fp32.json'}",
        f"train.global_batch_size={GLOBAL}", f"train.micro_batch_size={MICRO}",
        "data.seq_length=16", "optim.warmup_steps=1", "optim.clip_grad=0.5"])
    plan = RunPlan.build(config, world_size, rank)
    state.initialize_model_parallel(plan.layout)
    return Trainer(config, plan, torch.device("cpu")), config


def _train(trainer, config, rank: int, world_size: int) -> dict:
    start = {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters()}
    for step in range(3):
        trainer.train_step(micro_batches(step, GLOBAL, MICRO, rank, world_size,
                                         config.model.vocab_size))
    module = trainer.engine.module
    moments = trainer.optimizer.optimizer.state
    return {"weights": {n: p.detach().clone() for n, p in module.named_parameters()},
            "frozen": [n for n, p in module.named_parameters()
                       if torch.equal(p, start[n]) and not n.endswith(NO_GRADIENT)],
            "exp_avg": [moments[p]["exp_avg"].clone()
                        for g in trainer.optimizer.optimizer.param_groups for p in g["params"]]}


def _worker(rank, world_size):
    import deepspeed
    from deepspeed.checkpoint.constants import SINGLE_PARTITION_OF_FP32_GROUPS

    from megatron_rembert.training import main_grads

    deepspeed.init_distributed(dist_backend="gloo")
    trainer, config = _trainer(world_size, rank)
    opt = trainer.optimizer
    facts = {"main_grads": trainer.main_grads is not None, "hooks": len(opt._grad_acc_hooks)}
    facts["masters_are_weights"] = all(
        m.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        for m, flat in zip(opt.single_partition_of_fp32_groups, opt.bit16_groups_flat,
                           strict=True))
    ours = _train(trainer, config, rank, world_size)
    saved = opt.state_dict()[SINGLE_PARTITION_OF_FP32_GROUPS]
    facts["own_storage"] = all(t.untyped_storage().nbytes() == t.numel() * t.element_size()
                               for t in saved)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    facts["saved_bytes"] = buffer.tell()
    facts["partition_bytes"] = sum(t.numel() * t.element_size() for t in saved)
    del trainer

    real = main_grads.applies
    main_grads.applies = lambda config: False  # DeepSpeed's own path
    try:
        theirs_trainer, _ = _trainer(world_size, rank)
        assert theirs_trainer.main_grads is None
        theirs = _train(theirs_trainer, config, rank, world_size)
    finally:
        main_grads.applies = real
    facts["weights"] = max((ours["weights"][n] - theirs["weights"][n]).abs().max().item()
                           / max(theirs["weights"][n].abs().max().item(), 1e-12)
                           for n in theirs["weights"] if not n.endswith(NO_GRADIENT))
    facts["frozen"] = ours["frozen"]
    facts["exp_avg"] = max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
                           for a, b in zip(ours["exp_avg"], theirs["exp_avg"], strict=True))
    return facts


@pytest.mark.multiprocess
def test_fp32_zero1_main_gradients_match_deepspeeds_path():
    for facts in run_distributed(_worker, 2):
        assert facts["main_grads"] and facts["hooks"] == 0
        assert facts["masters_are_weights"]
        assert facts["own_storage"]
        # one partition of the model per rank on disk, not the whole flat buffer
        assert facts["saved_bytes"] < 1.1 * facts["partition_bytes"] + 10_000
        assert facts["frozen"] == [], facts["frozen"]  # every parameter trained
        assert facts["weights"] < 1e-5, facts
        assert facts["exp_avg"] < 1e-5, facts
