"""The trainer's production path (training/data_parallel.py: our gradient buffers and
distributed optimizer under DeepSpeed's public API) against DeepSpeed's own ZeRO-1 path on the
same batches, at dp 2 with accumulation and clipping active, fp32 (ds_configs/cpu_fp32.json):
- the same weights and Adam moments after three steps (the two paths sum the same fp32
  gradients in another order and bucket layout);
- DeepSpeed keeps our optimizer as it is, the model's weights are views of our buffers (fp32:
  the masters are those views, no second copy), and DeepSpeed issues no collective of its own
  during a step (counted at `deepspeed.comm`; its path, the control, does);
- the buckets' reduce-scatters start during the last micro-batch's backward (all but the last
  bucket: the embeddings come last in backward), not at the step;
- the checkpoint's optimizer file of each rank holds that rank's fragments only (12 bytes per
  parameter of its shard, not of the model).
train.py's loop on this path against plain torch: tests/training/test_production_path.py.
"""

from __future__ import annotations

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
DS_CALLS = ("all_reduce", "reduce_scatter_fn", "reduce_scatter_tensor",
            "all_gather_into_tensor", "allgather_fn", "broadcast")


def _trainer(world_size: int, rank: int):
    from megatron_rembert.parallel import state
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.plan import RunPlan

    config = build_config({"model": {"preset": "tiny"}}, [
        "train.precision=fp32", "parallel.zero_stage=1",
        f"parallel.ds_config={ROOT / 'ds_configs' / 'cpu_fp32.json'}",
        f"train.global_batch_size={GLOBAL}", f"train.micro_batch_size={MICRO}",
        "data.seq_length=16", "optim.warmup_steps=1", "optim.clip_grad=0.5",
        "parallel.grad_bucket_elements=20000"])
    plan = RunPlan.build(config, world_size, rank)
    state.initialize_model_parallel(plan.layout)
    return Trainer(config, plan, torch.device("cpu")), config


def _deepspeed_calls(calls: list) -> None:
    """Count DeepSpeed's calls of its communication module (its engines call through it)."""
    import deepspeed.comm as ds_comm

    for name in DS_CALLS:
        real = getattr(ds_comm, name, None)
        if real is not None:
            def counted(*args, _real=real, _name=name, **kwargs):
                calls.append(_name)
                return _real(*args, **kwargs)
            setattr(ds_comm, name, counted)


def _train(trainer, config, rank: int, world_size: int) -> dict:
    from megatron_rembert.training.full_tensors import local_parameters
    from tests.training.production import _masters_and_momentum

    start = {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters()}
    calls: list[str] = []
    _deepspeed_calls(calls)
    for step in range(3):
        trainer.train_step(micro_batches(step, GLOBAL, MICRO, rank, world_size,
                                         config.model.vocab_size))
    trainer.wait_for_weights()  # parallel.overlap_weight_gather leaves them in flight
    masters, moments = _masters_and_momentum(trainer)
    module = trainer.engine.module
    return {"weights": {n: p.detach().clone() for n, p in local_parameters(module)},
            "masters": masters, "exp_avg": moments, "deepspeed_calls": len(calls),
            "frozen": [n for n, p in module.named_parameters()
                       if torch.equal(p, start[n]) and not n.endswith(NO_GRADIENT)]}


def _worker(rank, world_size, folder):
    import deepspeed

    from megatron_rembert.checkpoint import optimizer_shards
    from megatron_rembert.training import data_parallel
    from megatron_rembert.training.checkpoint import _specs
    from megatron_rembert.training.distributed_optimizer import DistributedOptimizer

    deepspeed.init_distributed(dist_backend="gloo")
    trainer, config = _trainer(world_size, rank)
    opt = trainer.optimizer
    facts = {"ours": isinstance(opt, DistributedOptimizer) and trainer.engine.optimizer is opt}
    buffer = trainer.grad_buffer
    facts["views"] = all(
        p.untyped_storage().data_ptr() == buffer.offset(p)[0].weights.untyped_storage().data_ptr()
        for p in trainer.engine.module.parameters())
    facts["masters_are_weights"] = all(f.master is f.weight for f in opt.all_fragments())
    ours = _train(trainer, config, rank, world_size)
    facts["deepspeed_calls"] = ours["deepspeed_calls"]
    # buckets whose reduce-scatter the last step left to the optimizer (not started in backward)
    facts["buckets"], facts["started_at_step"] = len(buffer.buckets), buffer.started_in_finish
    meta = {"config": {"model": {"num_hidden_layers": config.model.num_hidden_layers}}}
    optimizer_shards.save(opt, _specs(trainer.engine, meta), folder, tp=1, tp_rank=0)
    facts["shard_bytes"] = (Path(folder) / optimizer_shards.shard_file(0, 0, rank)).stat().st_size
    facts["own_elements"] = sum(f.numel for f in opt.all_fragments())
    facts["model_elements"] = sum(p.numel() for p in trainer.engine.module.parameters())
    del trainer

    real = data_parallel.applies
    data_parallel.applies = lambda config: False  # DeepSpeed's own ZeRO-1 path
    try:
        theirs_trainer, _ = _trainer(world_size, rank)
        assert not theirs_trainer.owned
        theirs = _train(theirs_trainer, config, rank, world_size)
    finally:
        data_parallel.applies = real
    facts["their_calls"] = theirs["deepspeed_calls"]

    def worst(a: dict, b: dict) -> float:
        return max((a[n] - b[n]).abs().max().item() / max(b[n].abs().max().item(), 1e-12)
                   for n in b if not n.endswith(NO_GRADIENT))

    facts["weights"] = worst(ours["weights"], theirs["weights"])
    facts["masters"] = worst(ours["masters"], theirs["masters"])
    facts["exp_avg"] = worst(ours["exp_avg"], theirs["exp_avg"])
    facts["frozen"] = ours["frozen"]
    return facts


@pytest.mark.multiprocess
def test_production_path_steps_as_deepspeeds_zero1(tmp_path):
    for facts in run_distributed(_worker, 2, str(tmp_path)):
        assert facts["ours"] and facts["views"] and facts["masters_are_weights"]
        assert facts["deepspeed_calls"] == 0  # DeepSpeed communicates nothing on our path
        # the trainer arms the buckets for the last micro-batch: all but the last (the
        # embeddings', complete only when backward ends) start during its backward
        assert facts["buckets"] >= 3 and facts["started_at_step"] <= 1, facts
        assert facts["their_calls"] > 0  # ... and on its own path it does (the control)
        assert facts["frozen"] == [], facts["frozen"]  # every parameter trained
        assert facts["weights"] < 1e-5, facts
        assert facts["masters"] < 1e-5, facts
        assert facts["exp_avg"] < 1e-5, facts
        # this rank's fragments only: master + two moments in fp32, plus the header
        assert facts["own_elements"] < 0.6 * facts["model_elements"]
        assert 12 * facts["own_elements"] <= facts["shard_bytes"] \
            < 12 * facts["own_elements"] + 20_000


def _resume_worker(rank, world_size, folder):
    """A checkpoint of DeepSpeed's own ZeRO-1 optimizer (written as ours are, from its ZeRO
    partitions) resumed on ours for 2 more steps, against 4 uninterrupted steps on
    DeepSpeed's path; and the same resume with the Adam moments zeroed (the control)."""
    import deepspeed

    from megatron_rembert.checkpoint.step_folder import StepFolder
    from megatron_rembert.training import checkpoint as ckpt
    from megatron_rembert.training import data_parallel

    deepspeed.init_distributed(dist_backend="gloo")
    real = data_parallel.applies

    def trainer(owned: bool):
        data_parallel.applies = real if owned else (lambda config: False)
        try:
            return _trainer(world_size, rank)
        finally:
            data_parallel.applies = real

    def steps(t, config, which):
        for step in which:
            t.train_step(micro_batches(step, GLOBAL, MICRO, rank, world_size,
                                       config.model.vocab_size))

    theirs, config = trainer(owned=False)
    steps(theirs, config, range(2))
    meta = {"config": config.to_dict(), "layout": {"tp": 1, "pp": 1, "dp": world_size}}
    saved = ckpt.save_checkpoint(theirs.engine, folder, 2, 2 * GLOBAL, meta, keep_last=2)
    steps(theirs, config, range(2, 4))
    expected = {n: p.detach().clone() for n, p in theirs.engine.module.named_parameters()}
    del theirs
    out = {"files": sorted(p.name for p in Path(saved).rglob("*") if p.is_file())}
    for label in ("resumed", "without_moments"):
        ours, _ = trainer(owned=True)
        ckpt.load_checkpoint(ours.engine, StepFolder.open(saved), how="same")
        if label == "without_moments":
            for st in ours.optimizer.state.values():
                st["exp_avg"].zero_()
                st["exp_avg_sq"].zero_()
        steps(ours, config, range(2, 4))
        ours.wait_for_weights()  # parallel.overlap_weight_gather leaves the last gather due
        out[label] = max((p.detach() - expected[n]).abs().max().item()
                         / expected[n].abs().max().item()
                         for n, p in ours.engine.module.named_parameters()
                         if not n.endswith(NO_GRADIENT))
    return out


@pytest.mark.multiprocess
def test_a_checkpoint_of_deepspeeds_optimizer_resumes_on_ours(tmp_path):
    for out in run_distributed(_resume_worker, 2, str(tmp_path)):
        # our files only: each rank's shard of the masters and moments, its RNG states
        assert out["files"] == ["complete", "manifest.json", "meta.json",
                                "optim_tp00_pp000_dp000.safetensors",
                                "optim_tp00_pp000_dp001.safetensors", "rank_00000.pt",
                                "rank_00001.pt"], out
        assert out["resumed"] < 1e-5, out
        assert out["without_moments"] > 100 * out["resumed"], out  # the moments matter
