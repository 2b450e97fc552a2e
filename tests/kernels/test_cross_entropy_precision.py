"""bf16 linear_cross_entropy against an fp64 reference: losses and every gradient stay at bf16
accuracy, and the error does not grow with the number of row chunks and vocabulary blocks
(backward sums the tiles' products in fp32), for the torch path and the Triton path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_rembert.kernels import cross_entropy_tiling as tiles
from tests.kernels.ce_oracle import make_inputs
from tests.kernels.test_cross_entropy import run_ours

N, E, V = 256, 64, 300
MANY_ROWS = 4  # rows per chunk: 64 row chunks
MANY_BLOCK = 128  # vocabulary rows per backward block: 3 blocks (128, 128, 44)
# Relative Frobenius error against fp64: the logits and each result are rounded to bf16 once
# (unit roundoff 2^-8 = 3.9e-3; the errors average out over many elements). One tile
# measures 2.4e-3 (torch) and 3.4e-3 (Triton interpreter) here.
BOUND = 5e-3
# Error with many tiles / with one tile: rounding each tile's product once costs 1.1-1.25x,
# then stays flat. Summing grad_weight in bf16 (before the fp32 tiles) measured 8.5e-3, 3.7x
# (torch) and 8.8e-3, 2.6x (Triton) at 64 chunks.
GROWTH = 1.5


def fp64_reference(inp: dict) -> dict[str, torch.Tensor]:
    """Losses and gradients of the bf16 inputs, computed in fp64 on the full logits."""
    h, w, b = (inp[k].double().requires_grad_() for k in ("hidden", "weight", "bias"))
    logits = torch.addmm(b, h, w.t())  # N x V, fp64
    losses = F.cross_entropy(logits, inp["targets"], reduction="none")  # N
    (losses * inp["grad_out"].double()).sum().backward()
    return dict(loss=losses.detach(), hidden=h.grad, weight=w.grad, bias=b.grad)


def relative_errors(inp: dict, ref: dict, backend: str, chunk_size: int) -> dict[str, float]:
    losses, _, grads = run_ours(inp, V, backend, chunk_size)
    ours = dict(loss=losses, hidden=grads[0], weight=grads[1], bias=grads[2])
    assert all(ours[k].dtype == torch.bfloat16 for k in ("hidden", "weight", "bias"))
    return {k: ((ours[k].double() - ref[k]).norm() / ref[k].norm()).item() for k in ref}


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_error_does_not_grow_with_tiles(backend: str, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    inp = make_inputs(N, E, V, V, torch.bfloat16, bias=True, seed=11, zero_frac=0.0)
    ref = fp64_reference(inp)
    assert tiles.choose_tiling(V, E, N) == tiles.Tiling(N, N, V)  # one tile
    one = relative_errors(inp, ref, backend, N)
    monkeypatch.setattr(tiles, "CHUNK_ELEMENTS", MANY_BLOCK * E)  # budget of the fp32 block
    assert tiles.choose_tiling(V, E, MANY_ROWS) == tiles.Tiling(MANY_ROWS, MANY_ROWS, MANY_BLOCK)
    many = relative_errors(inp, ref, backend, MANY_ROWS)
    for name in ref:
        assert one[name] < BOUND and many[name] < BOUND, (name, one[name], many[name])
        assert many[name] <= GROWTH * one[name], (name, one[name], many[name])
