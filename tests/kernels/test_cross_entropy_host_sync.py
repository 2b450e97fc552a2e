"""The MLM loss runs without a host sync (tests/host_sync.py), forward and backward: the fused
loss on its torch and Triton (interpreter) paths, with logits recomputed and kept, the
reference loss, and the MLM head on both backends, fp32 and bf16, at TP = 1 and over 2 gloo
ranks. Weight-0 rows carry any target id (ce_oracle.padding_targets): results are checked
against the full-logits oracle outside the mode, so the mode watched real work."""

from __future__ import annotations

import pytest
import torch

from megatron_rembert.config import ModelConfig
from megatron_rembert.kernels.cross_entropy import linear_cross_entropy
from megatron_rembert.model.mlm_head import MLMHead
from megatron_rembert.parallel import state
from megatron_rembert.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_rembert.parallel.layers import init_weights
from megatron_rembert.parallel.layout import Layout
from tests.distributed import run_distributed
from tests.host_sync import forbid_host_syncs
from tests.kernels.ce_oracle import TOL, full_logits_reference, make_inputs, padding_targets

N, E, V, N_VALID = 21, 16, 300, 290  # chunks of 6: 6, 5, 5, 5


def fused_under_the_mode(inp: dict, backend: str, keep_logits_gib: float, **kw) -> tuple:  # noqa: ANN003
    h, w, b = (inp[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    with forbid_host_syncs():
        losses, correct = linear_cross_entropy(
            h, w, b, inp["targets"], inp["weights"], vocab_start=0, n_valid=N_VALID,
            chunk_size=6, keep_logits_gib=keep_logits_gib, backend=backend, **kw)
        (losses * inp["grad_out"]).sum().backward()
    return losses.detach(), correct, [h.grad, w.grad, b.grad]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kept_rows", [0, 11, N])
def test_fused_loss_has_no_host_sync(backend: str, dtype: torch.dtype, kept_rows: int) -> None:
    inp = make_inputs(N, E, V, N_VALID, dtype, bias=True, seed=1, zero_frac=0.4)
    assert (inp["weights"] == 0).sum() >= 4  # every kind of padding target is in
    losses, correct, grads = fused_under_the_mode(
        inp, backend, kept_rows * V * dtype.itemsize / 2**30)
    ref_losses, ref_correct, ref_grads = full_logits_reference(**inp, n_valid=N_VALID)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(losses, ref_losses, atol=atol, rtol=rtol)
    assert torch.equal(correct, ref_correct)
    for ours, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(ours.float(), ref.float(), atol=atol, rtol=rtol)
    padding = inp["weights"] == 0
    assert (losses[padding] == 0).all() and not correct[padding].any()
    assert (grads[0][padding] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_loss_has_no_host_sync(dtype: torch.dtype) -> None:
    inp = make_inputs(N, E, V, N_VALID, dtype, bias=True, seed=2, zero_frac=0.4)
    logits = torch.addmm(inp["bias"], inp["hidden"], inp["weight"].t()).requires_grad_()
    with forbid_host_syncs():
        losses, correct = vocab_parallel_cross_entropy(logits, inp["targets"], inp["weights"],
                                                       0, N_VALID)
        (losses * inp["grad_out"]).sum().backward()
    ref_losses, ref_correct, _ = full_logits_reference(**inp, n_valid=N_VALID)
    torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=1e-5)
    assert torch.equal(correct, ref_correct)
    padding = inp["weights"] == 0
    assert (logits.grad[padding] == 0).all() and (logits.grad[~padding] != 0).any()


def tiny_head_config(**changes) -> ModelConfig:  # noqa: ANN003
    return ModelConfig(vocab_size=300, hidden_size=24, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=48, input_embedding_size=8,
                       output_embedding_size=16, max_position_embeddings=64, **changes)


def head_under_the_mode(config: ModelConfig, dtype: torch.dtype) -> tuple[float, ...]:
    """The MLM head's loss sum, token count and correct count, run forward + backward inside
    forbid_host_syncs(), read back outside it."""
    torch.manual_seed(0)
    head = MLMHead(config)
    init_weights(head, 0, 0.5, "mlm_head.")
    head.to(dtype)
    hidden = torch.randn(N, config.hidden_size, dtype=dtype, requires_grad=True)
    weights = (torch.arange(N) % 3 != 0).float()  # 7 padding rows
    labels = torch.randint(0, config.vocab_size, (N,))
    labels[weights == 0] = padding_targets(7, config.vocab_size)
    with forbid_host_syncs():
        out = head(hidden, labels, weights)
        (out.loss_sum / out.num_tokens).backward()
    assert all(p.grad is not None for p in head.parameters())
    return out.loss_sum.item(), out.num_tokens.item(), out.num_correct.item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlm_head_has_no_host_sync(dtype: torch.dtype) -> None:
    fused = head_under_the_mode(tiny_head_config(loss_backend="fused"), dtype)
    kept = head_under_the_mode(tiny_head_config(loss_keep_logits_gib=0.0, loss_chunk_rows=4),
                               dtype)
    reference = head_under_the_mode(tiny_head_config(loss_backend="reference"), dtype)
    assert fused[1] == kept[1] == reference[1] == 14
    rtol = TOL[dtype][1]
    assert fused[0] == pytest.approx(reference[0], rel=rtol)
    assert kept[0] == pytest.approx(reference[0], rel=rtol)


def _tp_worker(rank: int, world_size: int) -> dict:
    state.initialize_model_parallel(Layout.build(world_size, rank, tp=world_size))
    try:
        results = {}
        for dtype in (torch.float32, torch.bfloat16):
            for backend in ("fused", "reference"):
                config = tiny_head_config(loss_backend=backend)
                results[backend, str(dtype)] = head_under_the_mode(config, dtype)
        # the Triton path with the parallel module's collectives, logits kept and not
        from megatron_rembert.parallel.cross_entropy import _reduce_max, _reduce_sum

        inp = make_inputs(N, E, V, N_VALID, torch.float32, bias=True, seed=3, zero_frac=0.4)
        lo = rank * V // world_size
        shard = {**inp, "weight": inp["weight"][lo:lo + V // world_size],
                 "bias": inp["bias"][lo:lo + V // world_size]}
        for keep in (0.0, 1.0):
            h, w, b = (shard[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
            with forbid_host_syncs():
                losses, _ = linear_cross_entropy(
                    h, w, b, inp["targets"], inp["weights"], vocab_start=lo,
                    n_valid=min(max(N_VALID - lo, 0), V // world_size), reduce_max=_reduce_max,
                    reduce_sum=_reduce_sum, chunk_size=6, keep_logits_gib=keep,
                    backend="triton")
                (losses * inp["grad_out"]).sum().backward()
            results["triton", keep] = losses.detach().numpy()
        return results
    finally:
        state.destroy_model_parallel()


@pytest.mark.multiprocess
def test_tensor_parallel_loss_has_no_host_sync() -> None:
    results = run_distributed(_tp_worker, 2)
    for dtype in (torch.float32, torch.bfloat16):
        for backend in ("fused", "reference"):
            one = head_under_the_mode(tiny_head_config(loss_backend=backend), dtype)
            for r in results:
                tp = r[backend, str(dtype)]
                assert tp[1] == one[1] and tp[0] == pytest.approx(one[0], rel=TOL[dtype][1])
    inp = make_inputs(N, E, V, N_VALID, torch.float32, bias=True, seed=3, zero_frac=0.4)
    ref = full_logits_reference(**inp, n_valid=N_VALID)[0]
    for r in results:
        for keep in (0.0, 1.0):
            torch.testing.assert_close(torch.from_numpy(r["triton", keep]), ref,
                                       atol=1e-5, rtol=1e-5)
