"""The fused loss's peak memory against its bound by construction (bench/loss_memory.py), in
bf16 on the CPU GEMM route that once broke it: torch's fallback GEMM (CPUs without AVX512;
forced here by disabling oneDNN) accumulates each bf16 product in an fp32 buffer of the
product's full shape. The loss before the tiled backward added every chunk's product into the
V x E grad_weight, so each such call held a V x E fp32 buffer: 2.4 GiB instead of about 1 at
rembert's head. Small tiles (a 2^20-element budget) give many vocabulary blocks at shapes that
run in seconds, where a V x E fp32 buffer is larger than the whole bound: one row chunk (its
product goes straight into grad_weight) and two (products summed in an fp32 block)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]

BUDGET = 2**20


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("loss_memory", ROOT / "bench" / "loss_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(("N", "V", "E", "chunks"), [(32, 8192, 1664, 1), (128, 81920, 64, 2)])
def test_bf16_peak_within_the_bound_on_the_fallback_gemm(
    bench: ModuleType, N: int, V: int, E: int, chunks: int  # noqa: N803 - the docs' names
) -> None:
    from megatron_rembert.kernels.cross_entropy import choose_tiling

    tiling = choose_tiling(V, E, None, BUDGET)
    assert -(-N // tiling.backward_rows) == chunks and V > 4 * tiling.vocab_block

    def extra(n: int, v: int, e: int) -> int:
        run = bench.run_variant("ours", n, v, e, "bf16", threads=2, no_mkldnn=True,
                                chunk_elements=BUDGET)
        assert "error" not in run, run
        return run["extra"]

    bound = sum(bench.ours_bound(N, V, E, 2, BUDGET).values())
    grad_weight = V * E * 2  # returned by the loss: the measurement must include it
    assert V * E * 4 > bound - grad_weight  # a V x E fp32 buffer alone would break the bound
    # What any first forward + backward in a fresh process adds whatever the shape (autograd's
    # engine thread, library set-up; ~10 MiB): measured at a shape whose buffers are ~0.2 MiB.
    fixed = extra(16, 256, 64)
    measured = extra(N, V, E) - fixed
    assert grad_weight <= measured <= bound, (measured / 2**20, bound / 2**20, fixed / 2**20)
