"""Vocab-parallel linear_cross_entropy over 2 and 3 gloo ranks against single-process
F.cross_entropy on the full logits, and with kept logits against the same op at TP = 1. The
reduce callables are built here from all_reduce, as `parallel/` builds them over the
tensor-parallel group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_rembert.kernels.cross_entropy import linear_cross_entropy
from tests.distributed import run_distributed
from tests.kernels.ce_oracle import TOL, full_logits_reference, make_inputs

pytestmark = pytest.mark.multiprocess  # every test here starts processes

N, E = 13, 16


def shard_worker(rank: int, world_size: int, real_vocab: int, v_pad: int, backend: str,
                 dtype, keep_rows: int) -> dict:  # noqa: ANN001
    v_local = v_pad // world_size
    inp = make_inputs(N, E, v_pad, real_vocab, dtype, bias=True, seed=7)  # same on every rank
    lo = rank * v_local
    n_valid = min(max(real_vocab - lo, 0), v_local)
    h = inp["hidden"].clone().requires_grad_()
    w = inp["weight"][lo : lo + v_local].clone().requires_grad_()  # V_local x E
    b = inp["bias"][lo : lo + v_local].clone().requires_grad_()  # V_local

    def reduce_max(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)

    def reduce_sum(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)

    tp = world_size > 1  # world_size 1: the same op in this process, unsharded
    losses, correct = linear_cross_entropy(
        h, w, b, inp["targets"], inp["weights"], vocab_start=lo, n_valid=n_valid,
        reduce_max=reduce_max if tp else None, reduce_sum=reduce_sum if tp else None,
        chunk_size=4, backend=backend,
        keep_logits_gib=keep_rows * v_local * dtype.itemsize / 2**30,
    )
    (losses * inp["grad_out"]).sum().backward()
    grad_h = h.grad.float()
    if tp:
        dist.all_reduce(grad_h)  # the caller's job: sum the shards' grad_hidden contributions
    out = dict(losses=losses.detach(), correct=correct, grad_h=grad_h, grad_w=w.grad,
               grad_b=b.grad)
    # numpy arrays travel by value (tensors would go through shared memory that dies with
    # the worker); bf16 has no numpy type, so grads travel as fp32 with their dtype
    arrays = {k: (v if v.dtype == torch.bool else v.float()).numpy() for k, v in out.items()}
    return dict(arrays, n_valid=n_valid, grad_dtype=str(w.grad.dtype))


@pytest.mark.parametrize(
    "world_size,real_vocab,v_pad,backend,dtype,keep_rows",
    [
        (2, 290, 320, "triton", torch.float32, 0),  # V_local 160: rank 1 has 130 valid columns
        (3, 290, 291, "torch", torch.bfloat16, 0),
        (3, 150, 240, "triton", torch.float32, 0),  # V_local 80: rank 2 is all padding
        # kept logits: rows 0-7 of 13 (chunks 4, 3, 3, 3 -> the first two kept), then all
        (2, 290, 320, "triton", torch.float32, 7),
        (2, 290, 320, "torch", torch.bfloat16, 13),
    ],
)
def test_vocab_parallel_matches_single_process(
    world_size: int, real_vocab: int, v_pad: int, backend: str, dtype: torch.dtype,
    keep_rows: int
) -> None:
    results = run_distributed(shard_worker, world_size, real_vocab, v_pad, backend, dtype,
                              keep_rows)
    assert all(r["grad_dtype"] == str(dtype) for r in results)
    results = [{k: torch.from_numpy(v) if k not in ("n_valid", "grad_dtype") else v
                for k, v in r.items()} for r in results]
    if real_vocab == 150:
        assert results[-1]["n_valid"] == 0
    inp = make_inputs(N, E, v_pad, real_vocab, dtype, bias=True, seed=7)
    losses, correct, (g_h, g_w, g_b) = full_logits_reference(**inp, n_valid=real_vocab)
    atol, rtol = TOL[dtype]
    for r in results:  # every rank sees the global loss, accuracy and grad_hidden
        torch.testing.assert_close(r["losses"], losses, atol=atol, rtol=rtol)
        assert torch.equal(r["correct"], correct)
        torch.testing.assert_close(r["grad_h"], g_h.float(), atol=atol, rtol=rtol)
    grad_w = torch.cat([r["grad_w"] for r in results])  # V_pad x E, gathered shards
    grad_b = torch.cat([r["grad_b"] for r in results])  # V_pad
    torch.testing.assert_close(grad_w.float(), g_w.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(grad_b.float(), g_b.float(), atol=atol, rtol=rtol)
    assert (grad_w[real_vocab:] == 0).all() and (grad_b[real_vocab:] == 0).all()
    if keep_rows:  # against the same op at TP = 1, keeping the same rows
        one = shard_worker(0, 1, real_vocab, v_pad, backend, dtype, keep_rows)
        torch.testing.assert_close(results[0]["losses"], torch.from_numpy(one["losses"]),
                                   atol=atol, rtol=rtol)
        assert torch.equal(results[0]["correct"], torch.from_numpy(one["correct"]))
        for key, tp in (("grad_h", results[0]["grad_h"]), ("grad_w", grad_w),
                        ("grad_b", grad_b)):
            torch.testing.assert_close(tp, torch.from_numpy(one[key]), atol=atol, rtol=rtol)
