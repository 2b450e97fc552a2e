"""The fused loss's peak memory against its bound by construction (bench.loss_memory), in
bf16 on the CPU GEMM route that once broke it: torch's fallback GEMM (CPUs without AVX512;
forced here by disabling oneDNN) accumulates each bf16 product in an fp32 buffer of the
product's full shape. The loss before the tiled backward added every chunk's product into the
V x E grad_weight, so each such call held a V x E fp32 buffer: 2.4 GiB instead of about 1 at
rembert's head. Small tiles (a 2^20-element budget) give many vocabulary blocks at shapes that
run in seconds, where a V x E fp32 buffer is larger than the whole bound: one row chunk (its
product goes straight into grad_weight) and two (products summed in an fp32 block); and with
half the rows' logits kept for backward (they count in the bound from forward to the end)."""

from __future__ import annotations

import sys
from types import ModuleType

import pytest

from bench import loss_memory

pytestmark = pytest.mark.multiprocess  # every test here starts processes

BUDGET = 2**20


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return loss_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(("N", "V", "E", "kept", "chunks"), [
    (32, 8192, 1664, 0, 1), (128, 81920, 64, 0, 2), (128, 81920, 64, 60, 3)])
def test_bf16_peak_within_the_bound_on_the_fallback_gemm(
    bench: ModuleType, N: int, V: int, E: int, kept: int, chunks: int  # noqa: N803
) -> None:
    from megatron_rembert.kernels.cross_entropy_tiling import choose_tiling, kept_rows, row_chunks

    tiling = choose_tiling(V, E, None, BUDGET)
    keep_gib = kept * V * 2 / 2**30
    keep = kept_rows(row_chunks(0, N, tiling.forward_rows), V, 2, keep_gib)  # whole chunks
    assert 0.75 * kept <= keep <= kept and V > 4 * tiling.vocab_block
    backward = row_chunks(0, keep, tiling.backward_rows) + row_chunks(keep, N,
                                                                     tiling.backward_rows)
    assert len(backward) == chunks

    def extra(n: int, v: int, e: int, keep_gib: float = 0.0) -> int:
        run = bench.run_variant("ours", n, v, e, "bf16", threads=2, no_mkldnn=True,
                                chunk_elements=BUDGET, keep_gib=keep_gib)
        assert "error" not in run, run
        return run["extra"]

    bound = sum(bench.ours_bound(N, V, E, 2, BUDGET, keep_gib).values())
    grad_weight = V * E * 2  # returned by the loss: the measurement must include it
    kept_bytes = keep * V * 2
    # a V x E fp32 buffer alone (the old addmm_ on the fallback) would break the bound
    assert V * E * 4 > bound - grad_weight - kept_bytes
    # What any first forward + backward in a fresh process adds whatever the shape (autograd's
    # engine thread, library set-up; ~10 MiB): measured at a shape whose buffers are ~0.2 MiB.
    fixed = extra(16, 256, 64)
    measured = extra(N, V, E, keep_gib) - fixed
    # kept logits are alive during the backward beside grad_weight
    assert grad_weight + kept_bytes <= measured <= bound, (
        measured / 2**20, bound / 2**20, fixed / 2**20)
