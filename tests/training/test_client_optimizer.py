"""DeepSpeed's public API carries our data-parallel gradient path (the plan of the issue "Own the
data-parallel gradient path"), proven before the trainer is moved onto it.

training/distributed_optimizer.py over parallel/grad_buffer.py, handed to
`deepspeed.initialize` as its client optimizer with a configuration that asks DeepSpeed for no
wrapper (ZeRO stage 0, bf16 and fp16 off, no clipping of its own); the weights stay in the
dtype the model was built in (bf16 here too: DeepSpeed casts nothing when bf16 is off). Every
micro-batch's backward runs through `engine.backward` inside `engine.no_sync()` and
`engine.step()` follows it (DeepSpeed's managed accumulation: an optimizer step at the
boundary only), at dp 2 on gloo ranks. Asserted:
- DeepSpeed keeps our optimizer as it is (`engine.optimizer is` ours);
- DeepSpeed issues no collective of its own during the steps (counted at `deepspeed.comm`),
  and the count is not blind: the same steps outside `no_sync` count DeepSpeed's all-reduce,
  and our optimizer's step then fails (`ForeignGradient`: DeepSpeed filled every `.grad`);
- the weights after the steps equal, bit for bit, those of the same optimizer driven without
  DeepSpeed (which tests/training/test_distributed_optimizer.py proves equal to one process),
  fp32 and bf16 weights;
- a step our optimizer skips (a non-finite gradient norm) is one DeepSpeed counts as skipped
  (`engine.skipped_steps`), and the LR schedule does not advance for it; otherwise the
  schedule advances once per global batch;
- pp 2 x dp 2: the trainer's pipeline module under DeepSpeed's pipeline engine, its DP
  reduction off by the engine's public `pipeline_enable_backward_allreduce`, our optimizer
  stepped by the engine's schedule: every stage's weights within 2e-6 of one process (measured
  1.2e-7), and DeepSpeed communicates nothing of gradient size (without the switch it
  all-reduces zero-filled gradients of every parameter, which the same count catches).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.helpers import micro_batches
from tests.training.test_distributed_optimizer import (
    BUCKET,
    CLIP,
    GLOBAL,
    LR,
    MICRO,
    _groups,
    _model,
    _tokens,
    step_losses,
)

STEPS, DP = 3, 2
GAS = GLOBAL // MICRO // DP
DS_CALLS = ("all_reduce", "all_reduce_coalesced", "inference_all_reduce", "reduce_scatter_fn",
            "reduce_scatter_tensor", "all_gather_into_tensor", "allgather_fn", "broadcast",
            "reduce")


def _ds_config() -> dict:
    return {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": GAS, "zero_optimization": {"stage": 0},
            "bf16": {"enabled": False}, "fp16": {"enabled": False},
            "gradient_clipping": 0.0, "steps_per_print": 10**9}


def _record_deepspeed_collectives(calls: list) -> None:
    """Record (function, elements of its tensor) of every call of DeepSpeed's communication
    functions (its engines call them through the `deepspeed.comm` module)."""
    import deepspeed.comm as ds_comm

    for name in DS_CALLS:
        real = getattr(ds_comm, name, None)
        if real is None:
            continue

        def recorded(*args, _real=real, _name=name, **kwargs):
            tensor = args[0] if args else next(iter(kwargs.values()), None)
            calls.append((_name, tensor.numel() if isinstance(tensor, torch.Tensor) else -1))
            return _real(*args, **kwargs)

        setattr(ds_comm, name, recorded)


def _counts(calls: list) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, _ in calls:
        out[name] = out.get(name, 0) + 1
    return out


def _worker(rank: int, dp: int, dtype: torch.dtype, engine_kind: str,
            nan_step: int | None = None):
    import deepspeed
    import torch.distributed as dist

    from megatron_rembert.parallel import comm
    from megatron_rembert.parallel.grad_buffer import ForeignGradient, GradBuffer
    from megatron_rembert.training.distributed_optimizer import DistributedOptimizer

    model, config = _model(dtype)
    buffer = GradBuffer(model.parameters(), dp_group=dist.group.WORLD, bucket_elements=BUCKET)
    opt = DistributedOptimizer(buffer, _groups(model),
                               lambda g: torch.optim.AdamW(g, lr=LR, fused=True),
                               clip_grad=CLIP)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    engine = None
    if engine_kind != "bare":
        engine, ds_opt, _, ds_scheduler = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=scheduler, config=_ds_config())
        assert ds_opt is opt and engine.optimizer is opt and ds_scheduler is scheduler
    calls: list[tuple[str, int]] = []
    _record_deepspeed_collectives(calls)
    lrs = []
    for step in range(STEPS):
        batches = micro_batches(step, GLOBAL, MICRO, rank, dp, config.model.vocab_size)
        tokens = comm.all_reduce(torch.tensor(_tokens(batches)))
        for loss in step_losses(model, buffer, batches, tokens,
                                step == nan_step and rank == dp - 1):
            if engine is None:
                loss.backward()
                continue
            loss = loss * GAS  # DeepSpeed divides every micro-batch's gradient by GAS
            if engine_kind == "no_sync":
                with engine.no_sync():
                    engine.backward(loss)
            else:
                engine.backward(loss)
            try:
                engine.step()
            except ForeignGradient as err:  # DeepSpeed's own reduction filled the .grads
                return {"counts": _counts(calls), "foreign": str(err)}
        if engine is None:
            opt.step()
            if not opt.overflow:
                scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    return {"weights": {n: p.detach().float().clone() for n, p in model.named_parameters()},
            "counts": _counts(calls), "lrs": lrs, "skipped": opt.skipped_steps,
            "ds_skipped": None if engine is None else engine.skipped_steps,
            "ds_steps": None if engine is None else engine.global_steps}


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_deepspeed_steps_our_optimizer_as_it_is(dtype):
    bare = run_distributed(_worker, DP, dtype, "bare", timeout=900)
    ours = run_distributed(_worker, DP, dtype, "no_sync", timeout=900)
    for b, o in zip(bare, ours, strict=True):
        assert o["counts"] == {}, o["counts"]  # DeepSpeed communicated nothing
        assert o["ds_steps"] == STEPS and o["ds_skipped"] == 0 == o["skipped"]
        assert o["lrs"] == b["lrs"] and len(set(o["lrs"])) == STEPS  # advanced every step
        for name, weight in b["weights"].items():
            assert torch.equal(o["weights"][name], weight), name
    moved = max(float((o - s).abs().max()) for o, s in
                zip(ours[0]["weights"].values(),
                    (p.detach().float() for p in _model(dtype)[0].parameters()), strict=True))
    assert moved > 0


@pytest.mark.multiprocess
def test_without_no_sync_deepspeed_all_reduces():
    """The counter sees DeepSpeed's own reduction when it is not switched off, and our
    optimizer's step refuses what it left (every parameter's .grad filled) at once."""
    results = run_distributed(_worker, DP, torch.float32, "plain", timeout=900)
    for r in results:
        print(f"DeepSpeed's collectives without no_sync: {r['counts']}")
        assert r["counts"].get("all_reduce", 0) + r["counts"].get("all_reduce_coalesced", 0) > 0
        assert "hold a .grad when the step reduces the gradient buffers" in r["foreign"]


@pytest.mark.multiprocess
def test_a_step_our_optimizer_skips_is_skipped_for_deepspeed():
    nan_step = 1
    bare = run_distributed(_worker, DP, torch.float32, "bare", nan_step, timeout=900)
    ours = run_distributed(_worker, DP, torch.float32, "no_sync", nan_step, timeout=900)
    for b, o in zip(bare, ours, strict=True):
        assert o["skipped"] == 1 == o["ds_skipped"] and o["ds_steps"] == STEPS
        # the schedule stood still over the skipped step: as in the run without DeepSpeed
        assert o["lrs"] == b["lrs"] and o["lrs"][nan_step] == o["lrs"][nan_step - 1]
        for name, weight in b["weights"].items():
            assert torch.equal(o["weights"][name], weight), name


def _pipeline_worker(rank: int, world: int):
    """pp 2 x dp 2: the trainer's pipeline module (its stage split and weights) under
    DeepSpeed's pipeline engine with our optimizer, DeepSpeed's DP reduction off by the
    engine's public switch; steps [0, STEPS) of the same global batches."""
    import deepspeed

    from megatron_rembert.model.pipeline import pipeline_inputs, set_unpadded
    from megatron_rembert.parallel import comm, state
    from megatron_rembert.parallel.grad_buffer import GradBuffer
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training.distributed_optimizer import DistributedOptimizer
    from megatron_rembert.training.engine import _build_pipeline, _StepContext
    from megatron_rembert.training.full_tensors import local_parameters
    from megatron_rembert.training.plan import RunPlan

    config = build_config({"model": {"preset": "tiny"}}, [
        "parallel.pp=2", "train.seed=0", f"train.global_batch_size={GLOBAL}",
        f"train.micro_batch_size={MICRO}", "train.precision=fp32", "parallel.zero_stage=1",
        "data.seq_length=16"])
    plan = RunPlan.build(config, world, rank)
    layout = state.initialize_model_parallel(plan.layout).layout
    deepspeed.init_distributed(dist_backend="gloo")  # the PipelineModule asks DeepSpeed's comm
    module = _build_pipeline(config, plan)
    named = local_parameters(module)  # global names, as the one-process reference's
    buffer = GradBuffer(module.parameters(), bucket_elements=BUCKET)
    opt = DistributedOptimizer(buffer, _groups(named),
                               lambda g: torch.optim.AdamW(g, lr=LR, fused=True),
                               clip_grad=CLIP)
    gas = GLOBAL // MICRO // layout.dp
    engine, ds_opt, _, _ = deepspeed.initialize(
        model=module, optimizer=opt, config={**_ds_config(), "gradient_accumulation_steps": gas})
    assert ds_opt is opt and engine.optimizer is opt
    engine.pipeline_enable_backward_allreduce = False  # the engine's public switch
    sizes: list[tuple[str, int]] = []
    _record_deepspeed_collectives(sizes)
    for step in range(STEPS):
        batches = micro_batches(step, GLOBAL, MICRO, layout.dp_rank, layout.dp,
                                config.model.vocab_size)
        tokens = comm.all_reduce(torch.tensor(_tokens(batches)),
                                 group=state.get_state().dp_group)
        context = _StepContext(tokens, gas)  # our DP reduction sums: no DP factor
        engine.module.loss_fn = context.scaled_loss
        set_unpadded(engine.module.forward_funcs, all(bool(mb["unpadded"]) for mb in batches))
        buffer.expect(gas)  # as the trainer: each bucket starts in this stage's last backward
        engine.train_batch(data_iter=iter([(pipeline_inputs(mb), ()) for mb in batches]))
    return {"weights": {n: p.detach().float().clone() for n, p in named},
            "sizes": sizes, "ds_steps": engine.global_steps, "skipped": opt.skipped_steps}


@pytest.mark.multiprocess
def test_deepspeed_pipeline_steps_our_optimizer():
    from tests.training.test_distributed_optimizer import _max_diff, _reference

    results = run_distributed(_pipeline_worker, 4, timeout=900)
    ref = _reference("adamw", steps=STEPS)
    names = set()
    for r in results:
        assert r["ds_steps"] == STEPS and r["skipped"] == 0
        # DeepSpeed communicated nothing of gradient size: only the step's loss, which its
        # engine broadcasts from the last stage (2 elements per step)
        assert r["sizes"] and all(0 <= n <= 2 for _, n in r["sizes"]), r["sizes"]
        expected = {n: ref["weights"][n] for n in r["weights"]}
        diff = _max_diff(r["weights"], expected)
        print(f"pp 2 x dp 2 under DeepSpeed's pipeline engine: max |w - w_ref| = {diff:.2e}")
        assert diff < 2e-6, diff
        names |= set(r["weights"])
    assert names == set(ref["weights"])  # the stages together hold every parameter
