"""The fused loss adding grad_weight and grad_bias into fp32 main gradients (the trainer's
buffers, parallel/grad_buffer.py) instead of returning them: the same sums, without the
rounding to the weight's dtype. In fp32 bitwise the returned gradients; in bf16 the main
gradient rounded once equals the returned bf16 gradient bitwise (the returned one is that same
fp32 sum, rounded); over micro-batches the main gradient keeps adding; autograd gets no
gradient for the two tensors. Several row chunks and vocabulary blocks, kept and recomputed
logits, both kernel paths; and through the MLM head."""

from __future__ import annotations

import pytest
import torch

from megatron_rembert.kernels import cross_entropy as ce
from megatron_rembert.kernels import cross_entropy_tiling as tiles
from megatron_rembert.model.mlm_head import MLMHead
from megatron_rembert.parallel.layers import init_weights
from tests.kernels.ce_oracle import make_inputs
from tests.kernels.test_cross_entropy import run_ours
from tests.model.helpers import small_config

N, E, V, N_VALID = 37, 16, 300, 290


def _into_run(inp: dict, backend: str, chunk: int | None, keep: float, passes: int = 1):
    """The op with main gradients, `passes` forward + backward in a row; -> (hidden grad of
    the last pass, weight main grad, bias main grad, weight.grad, bias.grad)."""
    w = inp["weight"].clone().requires_grad_()
    b = inp["bias"].clone().requires_grad_()
    into_w = torch.zeros(w.shape, dtype=torch.float32)
    into_b = torch.zeros(b.shape, dtype=torch.float32)
    for _ in range(passes):
        h = inp["hidden"].clone().requires_grad_()
        losses, _ = ce.linear_cross_entropy(
            h, w, b, inp["targets"], inp["weights"], vocab_start=0, n_valid=N_VALID,
            chunk_size=chunk, backend=backend, keep_logits_gib=keep, main_grads=(into_w, into_b))
        (losses * inp["grad_out"]).sum().backward()
    return h.grad, into_w, into_b, w.grad, b.grad


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk, keep", [(None, 0.0), (10, 0.0), (10, 1.0)],
                         ids=["one-chunk", "chunks", "chunks-kept"])
@pytest.mark.parametrize("piece_rows", [16, None], ids=["pieces", "whole-product"])
def test_main_grads_hold_the_returned_gradients(backend, dtype, chunk, keep, piece_rows,
                                                monkeypatch):
    monkeypatch.setattr(tiles, "CHUNK_ELEMENTS", 64 * E)  # 64-row vocabulary blocks: 5 blocks
    # a reduced-precision product added in fp32 in pieces (the CPU rule; 16 rows: 4 pieces of
    # a block, the last block 16 + 16 + 12) and whole (the GPU rule), each on CPU
    monkeypatch.setattr(ce, "product_rows", lambda device: piece_rows)
    inp = make_inputs(N, E, V, N_VALID, dtype, bias=True, seed=3)
    _, _, (_, grad_w, grad_b) = run_ours(inp, N_VALID, backend, chunk, keep_logits_gib=keep)
    grad_h, into_w, into_b, w_grad, b_grad = _into_run(inp, backend, chunk, keep)
    assert w_grad is None and b_grad is None  # autograd got nothing for them
    assert into_w.dtype == into_b.dtype == torch.float32
    assert torch.equal(into_w.to(dtype), grad_w)
    assert torch.equal(into_b.to(dtype), grad_b)
    assert into_w[:N_VALID].abs().sum() > 0
    reference_h = run_ours(inp, N_VALID, backend, chunk, keep_logits_gib=keep)[2][0]
    assert torch.equal(grad_h, reference_h)  # grad_hidden is returned as before


def test_main_grads_add_up_over_micro_batches():
    inp = make_inputs(N, E, V, N_VALID, torch.float32, bias=True, seed=4)
    _, once_w, once_b, _, _ = _into_run(inp, "torch", 10, 0.0)
    _, twice_w, twice_b, _, _ = _into_run(inp, "torch", 10, 0.0, passes=2)
    assert torch.allclose(twice_w, 2 * once_w, rtol=1e-5, atol=1e-7)
    assert torch.allclose(twice_b, 2 * once_b, rtol=1e-5, atol=1e-7)


def test_mlm_head_uses_its_decoder_main_grads():
    """A head whose decoder carries main gradients and their reports (as the trainer's buffer
    attaches them) sums into them and reports each; the decoder's .grad stays empty; the
    other parameters are unaffected."""
    config = small_config()
    heads, reports = [], []
    for with_main in (False, True):
        head = MLMHead(config)
        init_weights(head, 1, config.initializer_range)
        if with_main:
            for p in (head.decoder.weight, head.decoder.bias):
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
                p.main_grad_added = lambda p=p: reports.append(float(p.main_grad.abs().sum()))
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(12, config.hidden_size, generator=g)
        labels = torch.randint(0, config.vocab_size, (12,), generator=g)
        out = head(hidden, labels, torch.ones(12))
        out.loss_sum.backward()
        heads.append(head)
    plain, main = heads
    assert len(reports) == 2 and min(reports) > 0  # each reported once, after its addition
    assert main.decoder.weight.grad is None and main.decoder.bias.grad is None
    assert torch.equal(main.decoder.weight.main_grad, plain.decoder.weight.grad)
    assert torch.equal(main.decoder.bias.main_grad, plain.decoder.bias.grad)
    assert torch.equal(main.dense.weight.grad, plain.dense.weight.grad)


def test_main_grads_of_the_wrong_kind_are_refused():
    inp = make_inputs(4, E, V, N_VALID, torch.float32, bias=True)
    with pytest.raises(ValueError, match="main_grads"):
        ce.linear_cross_entropy(inp["hidden"], inp["weight"], inp["bias"], inp["targets"],
                                inp["weights"], vocab_start=0, n_valid=N_VALID,
                                main_grads=(torch.zeros(V, E, dtype=torch.bfloat16), None))


@pytest.mark.parametrize("piece_rows", [7, 1024, None], ids=["uneven-pieces", "one-piece",
                                                             "whole"])
def test_a_bf16_product_is_added_in_fp32_once_rounded(piece_rows):
    """_add_product_ into fp32: out + (a @ b) with the product rounded once to bf16 (within
    its rounding of the exact fp32 product), every row, any piece size; a.t() as the loss
    passes dlogits.t()."""
    g = torch.Generator().manual_seed(5)
    dlogits = torch.randn(23, 40, generator=g).bfloat16()  # C x Vb
    h = torch.randn(23, 12, generator=g).bfloat16()  # C x E
    out0 = torch.randn(40, 12, generator=g)
    out = out0.clone()
    ce._add_product_(out, dlogits.t(), h, piece_rows)
    exact = dlogits.t().double() @ h.double()
    # one bf16 rounding of the product (half a unit: 2^-8 relative), the GEMM's fp32
    # accumulation over C rows and the fp32 add
    magnitudes = dlogits.t().double().abs() @ h.double().abs()
    bound = (exact.abs() * 2.0**-8 * 1.001 + magnitudes * 23 * 2.0**-24
             + (out0.double().abs() + exact.abs()) * 2.0**-23)
    assert ((out.double() - out0.double() - exact).abs() <= bound).all()
    assert not torch.equal(out, out0 + exact.float())  # rounded, not the fp32 product
