"""The trainer's gradient path (training/data_parallel.py: our gradient buffers and
distributed optimizer under DeepSpeed's public API), at dp 2 with accumulation and clipping
active, fp32:
- every parameter trains; DeepSpeed keeps our optimizer as it is, the model's weights are views
  of our buffers (fp32: the masters are those views, no second copy), and DeepSpeed issues no
  collective of its own during a step (counted at `deepspeed.comm`;
  tests/training/test_client_optimizer.py shows the count catching its reduction);
- DeepSpeed's own optimizers (ZeRO, bf16, fp16) are constructed on no path: every precision,
  pp 1 and 2;
- a step in which DeepSpeed's own gradient reduction ran fails at once, naming a parameter;
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
        "train.precision=fp32", f"train.global_batch_size={GLOBAL}",
        f"train.micro_batch_size={MICRO}",
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
    facts["frozen"] = ours["frozen"]
    return facts


@pytest.mark.multiprocess
def test_the_gradient_path_trains_every_parameter_on_its_own(tmp_path):
    for facts in run_distributed(_worker, 2, str(tmp_path)):
        assert facts["ours"] and facts["views"] and facts["masters_are_weights"]
        assert facts["deepspeed_calls"] == 0  # DeepSpeed communicates nothing on our path
        # the trainer arms the buckets for the last micro-batch: all but the last (the
        # embeddings', complete only when backward ends) start during its backward
        assert facts["buckets"] >= 3 and facts["started_at_step"] <= 1, facts
        assert facts["frozen"] == [], facts["frozen"]  # every parameter trained
        # this rank's fragments only: master + two moments in fp32, plus the header
        assert facts["own_elements"] < 0.6 * facts["model_elements"]
        assert 12 * facts["own_elements"] <= facts["shard_bytes"] \
            < 12 * facts["own_elements"] + 20_000


# DeepSpeed's optimizers that a config could once select (its ZeRO 1/2 and 3, its bf16 and
# fp16 wrappers): module path, class name
DEEPSPEED_OPTIMIZERS = (
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"),
    ("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer"),
    ("deepspeed.runtime.fp16.fused_optimizer", "FP16_Optimizer"),
    ("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer"),
)


def _constructed_worker(rank, world_size, precision: str, pp: int) -> dict:
    """A trainer of `precision` at `pp` built and stepped once, with every DeepSpeed optimizer
    class's constructor recording that it ran."""
    import importlib

    import deepspeed

    from megatron_rembert.parallel import state
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.plan import RunPlan

    built = []
    for module, name in DEEPSPEED_OPTIMIZERS:
        cls = getattr(importlib.import_module(module), name)
        real = cls.__init__

        def init(self, *args, _real=real, _name=name, **kwargs):
            built.append(_name)
            _real(self, *args, **kwargs)

        cls.__init__ = init
    deepspeed.init_distributed(dist_backend="gloo")
    config = build_config({"model": {"preset": "tiny"}}, [
        f"train.precision={precision}", f"parallel.pp={pp}", f"train.global_batch_size={GLOBAL}",
        f"train.micro_batch_size={MICRO}", "data.seq_length=16"])
    plan = RunPlan.build(config, world_size, rank)
    s = state.initialize_model_parallel(plan.layout)
    trainer = Trainer(config, plan, torch.device("cpu"))
    trainer.train_step(micro_batches(0, GLOBAL, MICRO, s.dp_rank, plan.layout.dp,
                                     config.model.vocab_size))
    return {"built": built, "optimizer": type(trainer.engine.optimizer).__name__}


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision, pp", [("fp32", 1), ("bf16", 2), ("fp16", 1)])
def test_deepspeeds_optimizers_are_constructed_on_no_path(precision, pp):
    for out in run_distributed(_constructed_worker, pp, precision, pp, timeout=300):
        assert out == {"built": [], "optimizer": "DistributedOptimizer"}, out


def _reduction_worker(rank, world_size) -> str:
    """The trainer's step with DeepSpeed's own gradient reduction let through (its public
    switch, `no_sync`, made a no-op): the step must fail, not train on zero-filled gradients."""
    import contextlib

    import deepspeed

    from megatron_rembert.parallel.grad_buffer import ForeignGradient

    deepspeed.init_distributed(dist_backend="gloo")
    trainer, config = _trainer(world_size, rank)
    trainer.engine.no_sync = contextlib.nullcontext
    try:
        trainer.train_step(micro_batches(0, GLOBAL, MICRO, rank, world_size,
                                         config.model.vocab_size))
    except ForeignGradient as err:
        return str(err)
    return "trained"


@pytest.mark.multiprocess
def test_a_step_deepspeed_reduced_gradients_in_fails_at_once():
    for said in run_distributed(_reduction_worker, 2):
        assert "hold a .grad when the step reduces the gradient buffers" in said, said
