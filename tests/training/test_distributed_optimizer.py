"""training/distributed_optimizer.py over parallel/grad_buffer.py, on gloo ranks, against one
process with plain autograd and the plain optimizer:
- the tiny RemBERT (its embedding and fused-loss kernels add into `main_grad`) at dp 2 and 4
  with accumulation, clipping active, AdamW and LAMB (whose trust ratio is that of whole
  parameters, which straddle the ranks' shards): the same weights after several steps (fp32),
  and `full_tensors()` gives the reference's Adam moments;
- bytes on the wire per rank per step, counted at parallel/comm.py at dp 2 and 4 with bf16
  weights: (n-1)/n x 6 per parameter plus the buffers' padding (the fp32 all-reduce + bf16
  all-gather this replaced moved (n-1)/n x 10);
- a gradient that is not finite on one rank skips the step on every rank alike;
- fragment_states / load_fragment_states per rank resume the same steps;
- the weights' all-gather left in flight after the step (`overlap_weight_gather`): waited for
  unit by unit in the next forward, with the same weights bit for bit and the same bytes.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.helpers import micro_batches

GLOBAL, MICRO, STEPS = 16, 2, 4
LR, CLIP = 3e-3, 0.05  # CLIP below the gradient norms of these batches: clipping acts
BUCKET = 30_000  # elements: several buckets of the tiny model
# Softmax ignores a constant added to a row of scores: the key bias's gradient is rounding noise
# and its optimizer steps follow it (as in tests/training/test_production_path.py).
NO_GRADIENT = "key.bias"


def _model(dtype=torch.float32):
    from megatron_rembert.model.rembert import RemBertForPreTraining
    from megatron_rembert.run_config.load import build_config

    config = build_config({"model": {"preset": "tiny"}}, [])
    model = RemBertForPreTraining(config.model)
    model.init_weights(0)
    return model.to(dtype), config


def _groups(model) -> list[dict]:
    """The two weight-decay groups of a model, or of (name, parameter) pairs."""
    from megatron_rembert.checkpoint.specs import no_weight_decay

    named = model.named_parameters() if isinstance(model, torch.nn.Module) else model
    decay, no_decay = [], []
    for name, p in named:
        (no_decay if no_weight_decay(name, p.ndim) else decay).append(p)
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def _make(name: str):
    from megatron_rembert.training.lamb import Lamb

    if name == "lamb":
        return lambda groups: Lamb(groups, lr=LR)
    return lambda groups: torch.optim.AdamW(groups, lr=LR, fused=True)


def _tokens(batches: list[dict]) -> float:
    return float(sum(mb["masked_weights"].sum() for mb in batches))


def step_losses(model, buffer, batches: list[dict], tokens, poison: bool = False):
    """Each micro-batch's loss over the step's masked tokens, ready for backward, the gradient
    buffer told the step's number of backward passes; `poison`: multiplied by NaN."""
    for i, mb in enumerate(batches):
        if i == 0:
            buffer.expect(len(batches))
        loss = model(**mb).loss_sum / tokens
        yield loss * float("nan") if poison else loss


def _reference(optimizer: str, steps: int = STEPS, nan_step: int | None = None) -> dict:
    """One process: the whole global batch as micro-batches, plain autograd, the plain
    optimizer (torch's AdamW with its default implementation, or Lamb on whole parameters),
    torch's clipping."""
    model, config = _model()
    groups = _groups(model)
    opt = (torch.optim.AdamW(groups, lr=LR) if optimizer == "adamw"
           else _make("lamb")(groups))
    for step in range(steps):
        if step == nan_step:
            continue  # skipped by the distributed run
        batches = micro_batches(step, GLOBAL, MICRO, 0, 1, config.model.vocab_size)
        tokens = _tokens(batches)
        for mb in batches:
            (model(**mb).loss_sum / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    moments = {n: opt.state[p].get("exp_avg") for n, p in model.named_parameters()}
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "exp_avg": moments}


def _worker(rank: int, dp: int, optimizer: str, nan_step: int | None = None,
            dtype=torch.float32, steps: int = STEPS, resume_at: int | None = None,
            overlap: bool = False, wire_dtype=torch.float32):
    import torch.distributed as dist

    from megatron_rembert.parallel import comm
    from megatron_rembert.parallel.grad_buffer import GradBuffer
    from megatron_rembert.training.data_parallel import kernel_summed
    from megatron_rembert.training.distributed_optimizer import DistributedOptimizer

    def build():
        model, config = _model(dtype)
        buffer = GradBuffer(model.parameters(), dp_group=dist.group.WORLD,
                            bucket_elements=BUCKET, wire_dtype=wire_dtype,
                            summed_by_kernels=kernel_summed(
                                list(model.named_parameters()), config.model))
        opt = DistributedOptimizer(buffer, _groups(model), _make(optimizer), clip_grad=CLIP)
        if overlap:
            opt.overlap_weight_gather(model, GATHER_UNITS)
            for name, module in model.named_modules():  # after the optimizer's own hooks
                if isinstance(module, GATHER_UNITS):
                    module.register_forward_pre_hook(
                        lambda *_, name=name: at_units.append((name, opt.gathering)))
        return model, config, buffer, opt

    from megatron_rembert.training.engine import GATHER_UNITS

    at_units: list[tuple[str, list[int]]] = []  # (unit, buckets still in flight) at its forward
    model, config, buffer, opt = build()
    traffic, norms, saved, after_step, in_flight = [], [], None, [], []
    for step in range(steps):
        if step == resume_at:  # a fresh model and optimizer from this rank's state
            states, inner_step = opt.fragment_states()
            saved = ([{k: t.clone() for k, t in f.items()} for f in states], inner_step,
                     opt.steps, opt.skipped_steps)
            model, config, buffer, opt = build()
            opt.load_fragment_states(*saved)
        batches = micro_batches(step, GLOBAL, MICRO, rank, dp, config.model.vocab_size)
        at_units.clear()  # keep the last step's forward passes only
        comm.TRAFFIC.reset()
        tokens = comm.all_reduce(torch.tensor(_tokens(batches)))
        opt.start_weight_gather()  # the last step's weights, in flight from here (the trainer's
        in_flight.append(opt.gathering)  # order: after the step's blocking all-reduce)
        for loss in step_losses(model, buffer, batches, tokens,
                                step == nan_step and rank == dp - 1):
            loss.backward()
        opt.step()
        after_step.append(opt.gathering)
        traffic.append(dict(comm.TRAFFIC.wire_bytes))
        norms.append(opt.grad_norm)
    comm.TRAFFIC.reset()
    opt.wait_for_weights()  # the last step's all-gather, where the overlap left it to a wait
    traffic_after = dict(comm.TRAFFIC.wire_bytes)
    full = opt.full_tensors()
    names = [n for g in _groups(model) for n, p in
             ((n, p) for n, p in model.named_parameters() if any(p is q for q in g["params"]))]
    return {"weights": {n: p.detach().float().clone() for n, p in model.named_parameters()},
            "full_weights": dict(zip(names, full["weights"], strict=True)),
            "exp_avg": dict(zip(names, full["state"].get("exp_avg", []), strict=False)),
            "traffic": traffic, "traffic_after": traffic_after, "norms": norms,
            "skipped": opt.skipped_steps,
            "params": sum(p.numel() for p in model.parameters()),
            "padding": buffer.padding, "buckets": len(buffer.buckets),
            "after_step": after_step, "in_flight": in_flight, "at_units": at_units,
            "unit_buckets": {name: sorted({buffer.offset(p)[0].index
                                           for p in module.parameters()})
                             for name, module in model.named_modules()
                             if name in dict(at_units)}}


def _both_ways(rank: int, dp: int) -> tuple[dict, dict]:
    """The same steps with the weights' all-gather waited for in the step, then overlapped."""
    return (_worker(rank, dp, "adamw", dtype=torch.bfloat16, steps=3),
            _worker(rank, dp, "adamw", dtype=torch.bfloat16, steps=3, overlap=True))


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a if not n.endswith(NO_GRADIENT))


@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer, dp", [("adamw", 2), ("adamw", 4), ("lamb", 2),
                                           ("lamb", 4)])
def test_equals_one_process(optimizer, dp):
    ref = _reference(optimizer)
    results = run_distributed(_worker, dp, optimizer, timeout=900)
    start = _model()[0]
    moved = max(float((p.detach() - ref["weights"][n]).abs().max())
                for n, p in start.named_parameters())
    for r in results:
        assert r["buckets"] > 2 and r["skipped"] == 0
        assert min(r["norms"]) > CLIP  # clipping acted in every step
        diff = _max_diff(r["weights"], ref["weights"])
        print(f"{optimizer} dp={dp}: max |w - w_ref| = {diff:.2e} (weights moved {moved:.2e})")
        assert diff < 2e-6, diff
        assert _max_diff(r["full_weights"], ref["weights"]) < 2e-6
        assert torch.equal(torch.tensor(r["norms"]), torch.tensor(results[0]["norms"]))
    if optimizer == "adamw":  # the gathered optimizer state is the reference's
        diff = _max_diff(results[0]["exp_avg"], ref["exp_avg"])
        print(f"adamw dp={dp}: max |exp_avg - ref| = {diff:.2e}")
        assert diff < 1e-7, diff


@pytest.mark.multiprocess
@pytest.mark.parametrize("dp, wire", [(2, "fp32"), (4, "fp32"), (2, "bf16"), (4, "bf16")])
def test_bytes_per_parameter(dp, wire):
    wire_dtype, sent = {"fp32": (torch.float32, 4), "bf16": (torch.bfloat16, 2)}[wire]
    results = run_distributed(_worker, dp, "adamw", None, torch.bfloat16, 2, None, False,
                              wire_dtype, timeout=900)
    share = (dp - 1) / dp
    replaced = share * 10  # the path this replaced: fp32 all-reduce + bf16 all-gather
    reduce = "reduce-scatter" if wire == "fp32" else "all-to-all"
    for r in results:
        params, padding = r["params"], r["padding"]
        assert padding < 0.02 * params
        for traffic in r["traffic"]:
            ours = (traffic[reduce] + traffic["all-gather"]) / params
            print(f"dp={dp}, {wire} on the wire: {ours:.4f} B/param/rank (bound "
                  f"{share * (sent + 2):.4f} + padding; the all-reduce path {replaced:.4f})")
            # the gradients' reduction and the bf16 all-gather of every buffer element
            assert ours == pytest.approx(share * (sent + 2) * (params + padding) / params,
                                         rel=1e-12)
            assert ours < (0.61 if wire == "fp32" else 0.41) * replaced
            assert traffic["all-reduce"] <= 3 * 8  # the token count and the norm's scalars


@pytest.mark.multiprocess
def test_non_finite_gradient_skips_the_step_on_every_rank():
    nan_step = 1
    results = run_distributed(_worker, 2, "adamw", nan_step, timeout=900)
    ref = _reference("adamw", nan_step=nan_step)
    for r in results:
        assert r["skipped"] == 1
        assert all(n != n for n in r["norms"][nan_step:nan_step + 1])  # nan, on both ranks
        # the other steps are the reference's, which never took the skipped one
        assert _max_diff(r["weights"], ref["weights"]) < 2e-6
    assert torch.equal(torch.cat([w.flatten() for w in results[0]["weights"].values()]),
                       torch.cat([w.flatten() for w in results[1]["weights"].values()]))


@pytest.mark.multiprocess
def test_state_dict_resumes_the_same_steps():
    results = run_distributed(_worker, 2, "lamb", None, torch.float32, STEPS, 2, timeout=900)
    ref = _reference("lamb")
    for r in results:
        assert _max_diff(r["weights"], ref["weights"]) < 2e-6


@pytest.mark.multiprocess
def test_weight_gather_overlaps_the_next_forward():
    """bf16 weights at dp 2: the step returns with nothing issued, and `start_weight_gather`
    (where the trainer calls it: at the next step, after its blocking all-reduce) leaves every
    bucket's all-gather in flight; in the next forward each unit finds its own buckets waited
    for and the later units' still in flight (the host waited for nothing more than the
    forward so far needed); the weights, norms and bytes on the wire equal those of the step
    that waits, bit for bit."""
    for waited, overlapped in run_distributed(_both_ways, 2, timeout=900):
        buckets = list(range(overlapped["buckets"]))
        assert waited["after_step"] == overlapped["after_step"] == [[]] * 3
        assert waited["in_flight"] == [[]] * 3  # the control: nothing left in flight
        assert overlapped["in_flight"] == [[]] + [buckets] * 2  # step 1 has none to gather
        seen = overlapped["at_units"]  # the last step's forward passes, unit by unit
        first = seen[0]
        assert first[0] == "rembert.embeddings", seen
        own = overlapped["unit_buckets"]
        assert not set(own[first[0]]) & set(first[1])  # its own weights are in ...
        assert len(first[1]) >= 2  # ... while the other units' are still in flight
        for name, pending in seen:
            assert not set(own[name]) & set(pending), (name, pending)
        assert [p for n, p in seen if n == "mlm_head"][0] == []  # the head's bucket came last
        assert overlapped["norms"] == waited["norms"]
        def total(r):  # the same bytes, the overlap's all-gather one step later
            return sum((Counter(t) for t in r["traffic"] + [r["traffic_after"]]), Counter())

        assert total(overlapped) == total(waited)
        assert waited["traffic_after"] == {}
        for name, weight in waited["weights"].items():
            assert torch.equal(overlapped["weights"][name], weight), name


def test_fragment_states_are_taken_one_at_a_time():
    """A resume reads each fragment's tensors only when the optimizer reaches it: the master
    of fragment k is in place before fragment k + 1 is read (all read first would hold a copy
    of the rank's weights at the resume's peak). A count that does not match is refused."""
    from megatron_rembert.parallel.grad_buffer import GradBuffer
    from megatron_rembert.training.distributed_optimizer import DistributedOptimizer

    def build():
        model, _ = _model()
        buffer = GradBuffer(model.parameters(), bucket_elements=BUCKET)
        return buffer, DistributedOptimizer(buffer, _groups(model), _make("adamw"))

    _, source = build()
    with torch.no_grad():
        for f in source.all_fragments():
            f.master.add_(1.0)  # the saved masters differ from a fresh model's
    saved, _ = source.fragment_states()
    buffer, target = build()
    frags = target.all_fragments()
    order = []

    def reading():
        for k, tensors in enumerate(saved):
            if k > 0:  # the previous master is in place when this fragment is read
                order.append(torch.equal(frags[k - 1].master, saved[k - 1]["master"]))
            yield {key: t.clone() for key, t in tensors.items()}

    target.load_fragment_states(reading(), 1, 1, 0)
    assert len(order) == len(frags) - 1 and all(order)
    assert all(torch.equal(f.master, s["master"]) for f, s in zip(frags, saved, strict=True))
    with pytest.raises(ValueError, match=f"the {len(frags)} fragments"):
        build()[1].load_fragment_states(iter(saved[:-1]), 1, 1, 0)
    with pytest.raises(ValueError, match=f"the {len(frags)} fragments"):
        build()[1].load_fragment_states(saved + saved[:1], 1, 1, 0)
