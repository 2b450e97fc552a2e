"""No gradient bucket starts its reduce-scatter before its last micro-batch's backward has added
every gradient in it, for every parameter (the embedding tables and the output projection,
whose kernels add their gradients themselves, included), on every torch the package accepts.

At dp 2 through the trainer (fused loss, accumulation over 2 micro-batches, small buckets):
each bucket's gradients are copied when its reduce-scatter starts and compared, when the step
waits for the buckets, with what is there then (the parts of the bucket this rank does not own,
which the reduce-scatter only reads; the two ranks together cover every element): any gradient
that arrived after its bucket started shows up as a difference. Run twice: as this torch's
autograd behaves, and as older torch versions behave, whose AccumulateGrad does not call the
post-accumulate hook for a parameter whose gradient is undefined (the kernels' parameters).
The control: with the kernels' reports switched off, the same check fails (their buckets start
before the forward, and their gradients reach them late).
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.training.helpers import GLOBAL_BATCH, MICRO, micro_batches

pytestmark = pytest.mark.multiprocess  # every test here starts processes

KERNEL_SUMMED = ("word_embeddings.weight", "decoder.weight", "decoder.bias")


def _worker(rank, world_size, hook_on_undefined: bool, reports: bool) -> dict:
    import deepspeed
    import torch

    from megatron_rembert.parallel import state
    from megatron_rembert.parallel.grad_buffer import GradBuffer
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.plan import RunPlan

    if not hook_on_undefined:  # an older torch's AccumulateGrad
        register = torch.Tensor.register_post_accumulate_grad_hook

        def register_older(param, hook):
            return register(param, lambda p: None if p.grad is None else hook(p))

        torch.Tensor.register_post_accumulate_grad_hook = register_older
    if not reports:  # the control: kernels whose additions nobody counts
        GradBuffer._on_kernel_added = lambda self, param: None
    started: dict[int, torch.Tensor] = {}
    late: list[list[str]] = []
    counted_in_backward: list[int] = []
    real_start, real_finish = GradBuffer._start, GradBuffer.finish

    def others(buffer, bucket) -> torch.Tensor:  # the elements this rank does not own
        lo, hi = bucket.shard_range(buffer.dp_rank, buffer.dp)
        return torch.cat([bucket.grads[:lo], bucket.grads[hi:]])

    def start(self, bucket):
        started[bucket.index] = others(self, bucket).clone()
        return real_start(self, bucket)

    def finish(self):
        changed = set()
        for b in self.buckets:
            if b.index in started and not torch.equal(started[b.index], others(self, b)):
                changed.update(self._names[id(p)] for p in b.params
                               if _changed(self, b, p, started[b.index]))
        late.append(sorted(changed))
        counted_in_backward.append(len(started))
        started.clear()
        return real_finish(self)

    GradBuffer._start, GradBuffer.finish = start, finish
    deepspeed.init_distributed(dist_backend="gloo")
    config = build_config({"model": {"preset": "tiny"}}, [
        "train.global_batch_size=8", "train.micro_batch_size=2", "train.precision=fp32",
        "data.seq_length=16", "parallel.grad_bucket_elements=3000", "train.steps=5"])
    plan = RunPlan.build(config, world_size, rank)
    s = state.initialize_model_parallel(plan.layout)
    trainer = Trainer(config, plan, torch.device("cpu"))
    buffer = trainer.grad_buffer
    for step in range(3):
        trainer.train_step(micro_batches(step, GLOBAL_BATCH, MICRO, s.dp_rank, plan.layout.dp,
                                         config.model.vocab_size))
    kernel_buckets = {buffer._names[id(p)]: buffer.offset(p)[0].index
                      for p in buffer.params() if buffer._names[id(p)].endswith(KERNEL_SUMMED)}
    return {"late": late, "started_in_backward": counted_in_backward,
            "buckets": len(buffer.buckets), "kernel_buckets": kernel_buckets,
            "gas": plan.layout.gas}


def _changed(buffer, bucket, param, before) -> bool:
    """Whether `param`'s elements outside this rank's shard differ from `before` (the copy of
    those parts taken when the bucket started)."""
    import torch

    lo, hi = bucket.shard_range(buffer.dp_rank, buffer.dp)
    now = torch.cat([bucket.grads[:lo], bucket.grads[hi:]])
    start = buffer.offset(param)[1]
    mask = torch.zeros(bucket.numel, dtype=torch.bool)
    mask[start:start + param.numel()] = True
    mask = torch.cat([mask[:lo], mask[hi:]])
    return not torch.equal(now[mask], before[mask])


@pytest.mark.parametrize("hook_on_undefined", [True, False], ids=["this-torch", "older-torch"])
def test_no_bucket_starts_before_its_gradients_are_in(hook_on_undefined):
    for rank, r in enumerate(run_distributed(_worker, 2, hook_on_undefined, True, timeout=300)):
        assert r["gas"] == 2
        assert r["late"] == [[], [], []], rank
        # every bucket but at most the first step's unused parameters' started in backward
        assert r["started_in_backward"][1:] == [r["buckets"]] * 2, rank
        assert len(r["kernel_buckets"]) == 3


def test_the_check_catches_gradients_that_arrive_after_their_bucket_started():
    """The control: an older torch, and kernels that do not report. The kernels' parameters
    look unused after the first step, so their buckets start before the forward; their
    gradients then arrive late, and the check names them."""
    for rank, r in enumerate(run_distributed(_worker, 2, False, False, timeout=300)):
        late = set(r["late"][1]) | set(r["late"][2])
        assert any(name.endswith(KERNEL_SUMMED) for name in late), (rank, r["late"])
