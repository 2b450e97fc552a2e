"""parallel/grad_buffer.py: the buffers' layout, accumulation into `main_grad` (autograd's
gradients by the hook, the embedding kernel's by itself), and the bucketed reduce-scatter over
gloo ranks against the gradients of one process; told the step's number of backward passes,
the first bucket's reduce-scatter starts during the last one, before it has reached the first
layer, and not before; a bucket whose hooks ran fewer times waits for `finish()`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_rembert.parallel.grad_buffer import ALIGN, GradBuffer
from megatron_rembert.parallel.layers import VocabParallelEmbedding
from tests.distributed import run_distributed

VOCAB, WIDTH, LAYERS = 40, 24, 4


class Net(nn.Module):
    """An embedding table (its gradient added into main_grad by the kernel) and a stack of
    linears: a gradient per layer, in reverse order of registration."""

    def __init__(self, seed: int = 0, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = VocabParallelEmbedding(VOCAB, WIDTH, VOCAB)
        nn.init.normal_(self.embed.weight, std=0.5)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.unused = nn.Linear(2, 2)  # takes no part in forward
        self.to(dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.float().square().mean()


def batches(rank: int, count: int, rows: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, VOCAB, (rows, 5), generator=g) for _ in range(count)]


def reference_grads(dp: int, gas: int, ranks=None) -> dict[str, torch.Tensor]:
    """Summed over every rank's micro-batches (or those of `ranks`), in one process, by plain
    autograd."""
    net = Net()
    for rank in range(dp) if ranks is None else ranks:
        for ids in batches(rank, gas):
            net(ids).backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p))
            for n, p in net.named_parameters()}


def test_layout_views_and_accumulation():
    net = Net()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    buf = GradBuffer(net.parameters(), summed_by_kernels=[net.embed.weight],
                     bucket_elements=WIDTH * WIDTH + WIDTH)
    params = list(net.parameters())
    assert buf.params() == params[::-1]  # reverse registration order
    for n, p in net.named_parameters():
        bucket, offset = buf.offset(p)
        assert (bucket.start + offset) % ALIGN == 0
        assert p.main_grad.dtype == torch.float32 and p.main_grad.shape == p.shape
        assert p.untyped_storage().data_ptr() == bucket.weights.untyped_storage().data_ptr()
        assert torch.equal(p, before[n])
    assert all(b.numel % ALIGN == 0 for b in buf.buckets) and len(buf.buckets) > 2
    ref = reference_grads(1, 3)
    for ids in batches(0, 3):
        net(ids).backward()
    for n, p in net.named_parameters():
        assert p.grad is None, n
        torch.testing.assert_close(p.main_grad, ref[n], rtol=1e-6, atol=1e-7)
    buf.finish()
    buf.zero()
    assert all(not p.main_grad.any() for p in params)


def test_the_hooks_do_not_keep_the_buffer_alive():
    """A trainer dropped while its model lives on (a second trainer, a bench) must free the
    buffers: the parameters' hooks reach the buffer only weakly, and do nothing once it is gone."""
    import gc
    import weakref

    net = Net()
    buf = GradBuffer(net.parameters(), summed_by_kernels=[net.embed.weight])
    gone = weakref.ref(buf)
    del buf
    gc.collect()
    assert gone() is None
    net(batches(0, 1)[0]).backward()  # the orphaned hooks are harmless
    assert net.layers[0].weight.grad is not None


def test_bad_settings():
    with pytest.raises(ValueError, match="reduce='max'"):
        GradBuffer(Net().parameters(), reduce="max")
    with pytest.raises(ValueError, match="bucket_elements=0"):
        GradBuffer(Net().parameters(), bucket_elements=0)


def _reduce_worker(rank: int, world_size: int, gas: int, reduce: str, overlap: bool,
                   wire_dtype=torch.float32):
    from megatron_rembert.parallel import comm

    net = Net()
    buf = GradBuffer(net.parameters(), summed_by_kernels=[net.embed.weight],
                     dp_group=torch.distributed.group.WORLD,
                     bucket_elements=WIDTH * WIDTH + WIDTH, reduce=reduce,
                     wire_dtype=wire_dtype)
    events: list[str] = []
    start = comm.reduce_scatter

    def recorded(output, input, group=None, async_op=False, _start=start):
        events.append(f"reduce-scatter {len(events)}")
        return _start(output, input, group, async_op)

    comm.reduce_scatter = recorded
    comm.all_to_all = lambda output, input, group=None, async_op=False, _a2a=comm.all_to_all: \
        recorded(output, input, group, async_op, _start=_a2a)
    first = net.layers[0].weight  # the last gradient autograd computes among the linears
    first.register_post_accumulate_grad_hook(lambda p: events.append("first layer's gradient"))
    for step in range(2):  # the first step learns which parameter takes no part
        if step == 1:
            buf.zero()
            del events[:]
            comm.TRAFFIC.reset()
        for i, ids in enumerate(batches(rank, gas)):
            if i == 0 and overlap:
                buf.expect(gas)
            net(ids).backward()
            events.append(f"backward {i} ends")
        buf.finish()
        if step == 0:
            started_in_finish = buf.started_in_finish
    shards = {n: [] for n, _ in net.named_parameters()}
    for n, p in net.named_parameters():
        bucket, offset = buf.offset(p)
        lo, hi = bucket.shard_range(rank, world_size)
        flat = bucket.grads
        shards[n] = (max(lo, offset), min(hi, offset + p.numel()),
                     flat[max(lo, offset):max(min(hi, offset + p.numel()), max(lo, offset))]
                     .clone())
    return {"events": events, "shards": shards, "started_in_finish": buf.started_in_finish,
            "first_step_started_in_finish": started_in_finish,
            "buckets": len(buf.buckets), "traffic": dict(comm.TRAFFIC.wire_bytes),
            "buffer": sum(g.grads.numel() for g in buf.groups)}


def _assemble(results: list, name: str, like: torch.Tensor) -> torch.Tensor:
    """A parameter's reduced gradient from the ranks' shards (offsets relative to its bucket)."""
    parts = {}
    for r in results:
        lo, hi, values = r["shards"][name]
        if hi > lo:
            parts[lo] = values
    return torch.cat([parts[k] for k in sorted(parts)]).view(like.shape)


@pytest.mark.multiprocess
@pytest.mark.parametrize("dp, reduce", [(2, "sum"), (4, "mean")])
def test_reduce_scatter_equals_one_process(dp, reduce):
    gas = 2
    ref = reference_grads(dp, gas)
    results = run_distributed(_reduce_worker, dp, gas, reduce, True)
    for name, grad in ref.items():
        expected = grad / dp if reduce == "mean" else grad
        torch.testing.assert_close(_assemble(results, name, grad), expected, rtol=1e-6,
                                   atol=1e-7)
    # each bucket once, as a ring reduce-scatter of fp32: (n-1)/n x 4 bytes per element
    for r in results:
        assert r["traffic"] == {"reduce-scatter": r["buffer"] * 4 * (dp - 1) / dp}


@pytest.mark.multiprocess
def test_first_bucket_starts_during_the_last_backward():
    gas = 3
    overlapped = run_distributed(_reduce_worker, 2, gas, "sum", True)
    at_end = run_distributed(_reduce_worker, 2, gas, "sum", False)
    for r in overlapped:
        events = r["events"]
        last_backward = events.index(f"backward {gas - 1} ends")
        first_start = next(i for i, e in enumerate(events) if e.startswith("reduce-scatter"))
        # the last micro-batch's first-layer gradient comes after the first bucket started
        first_layer = [i for i, e in enumerate(events) if e == "first layer's gradient"][-1]
        assert events.index(f"backward {gas - 2} ends") < first_start < first_layer \
            < last_backward, events
        # every bucket started inside backward; in the first step the unused linear's (the
        # first bucket) held every bucket back until finish()
        assert r["started_in_finish"] == 0 and r["buckets"] > 2
        assert r["first_step_started_in_finish"] == r["buckets"]
    for r in at_end:
        assert r["started_in_finish"] == r["buckets"]
    for a, b in zip(overlapped, at_end, strict=True):  # the same sums, bit for bit
        for name, (lo, hi, values) in a["shards"].items():
            assert b["shards"][name][:2] == (lo, hi) and torch.equal(values,
                                                                     b["shards"][name][2])


def test_a_gradient_after_its_bucket_started_fails_naming_the_parameter():
    net = Net()
    buf = GradBuffer(net.parameters(), summed_by_kernels=[net.embed.weight],
                     bucket_elements=1)  # a bucket per parameter
    buf.name(net.unused.weight, "unused.weight")
    buf.name(net.unused.bias, "unused.bias")
    ids = batches(0, 1)[0]
    buf.expect(1)
    net(ids).backward()
    buf.finish()  # `unused` got no gradient: from now on it is ready from the start
    buf.expect(1)
    with pytest.raises(RuntimeError, match=r"unused\.(weight|bias) got a gradient after its"):
        (net(ids) + net.unused(torch.ones(2)).sum()).backward()


@pytest.mark.parametrize("expected, passes", [(2, 2), (3, 2), (1, 1)])
def test_buckets_start_once_every_expected_pass_is_in(expected, passes):
    """One process: a bucket "starts" (nothing to send) when each of its parameters' hooks ran
    once per expected backward pass; told of more passes than ran, every bucket waits for
    finish(). The first step learns which parameter takes no part."""
    net = Net()
    buf = GradBuffer(net.parameters(), summed_by_kernels=[net.embed.weight],
                     bucket_elements=1)  # a bucket per parameter
    for _ in range(2):
        buf.zero()
        buf.expect(expected)
        for ids in batches(0, passes):
            net(ids).backward()
        buf.finish()
    held = buf.started_in_finish
    # the unused linear's weight and bias (registered last: the buffer's first two buckets)
    # are ready from the start
    assert held == (0 if expected == passes else len(buf.buckets) - 2), held
    with pytest.raises(ValueError, match="passes=0"):
        buf.expect(0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("dp", [2, 4])
def test_bf16_on_the_wire_is_each_ranks_gradient_rounded_once_and_summed_in_fp32(dp):
    """wire_dtype=bf16: every reduced element is the fp32 sum of the ranks' gradients each
    rounded to bf16 once (so within 2^-8 of the sum of their magnitudes from the fp32 sum),
    for (n-1)/n x 2 bytes per element on the wire; and not the fp32 result (the control)."""
    gas = 2
    per_rank = [reference_grads(dp, gas, ranks=[r]) for r in range(dp)]
    results = run_distributed(_reduce_worker, dp, gas, "sum", True, torch.bfloat16)
    fp32 = run_distributed(_reduce_worker, dp, gas, "sum", True)
    differs = False
    for name, like in per_rank[0].items():
        got = _assemble(results, name, like)
        rounded = torch.stack([g[name].bfloat16().float() for g in per_rank]).sum(0)
        torch.testing.assert_close(got, rounded, rtol=1e-6, atol=1e-9)
        exact = _assemble(fp32, name, like)
        bound = 2.0**-8 * torch.stack([g[name].abs() for g in per_rank]).sum(0)
        assert ((got - exact).abs() <= bound + 1e-12).all(), name
        differs |= not torch.equal(got, exact)
    assert differs
    for r in results:  # every bucket once, an all-to-all of its bf16 copy
        assert r["traffic"] == {"all-to-all": r["buffer"] * 2 * (dp - 1) / dp}
        assert r["started_in_finish"] == 0  # started during the last backward, as fp32's
