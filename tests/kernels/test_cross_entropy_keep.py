"""Kept logits (keep_logits_gib > 0) against recomputed ones: the same losses and gradients,
with every chunk kept, none, or some kept and the rest recomputed in one call; Triton
(interpreter) and torch paths, fp32 and bf16, odd shapes with vocabulary padding. Backward
must skip the GEMM of exactly the kept rows."""

from __future__ import annotations

import pytest
import torch

from megatron_rembert.kernels import cross_entropy as ce
from megatron_rembert.kernels import cross_entropy_tiling as tiles
from tests.kernels.ce_oracle import TOL, full_logits_reference, make_inputs
from tests.kernels.test_cross_entropy import assert_matches, run_ours


def gib_for_rows(rows: int, v: int, dtype: torch.dtype) -> float:
    """A budget that holds the logits of exactly `rows` rows."""
    return rows * v * dtype.itemsize / 2**30


# (N, E, V_local, n_valid, chunk_size, kept rows): the kept rows are whole forward chunks
# (N = 37 at 10 a chunk: 10, 9, 9, 9)
CASES = {
    "all kept": (37, 16, 300, 290, 10, 37),
    "some kept": (37, 16, 300, 290, 10, 19),
    "budget between chunks": (37, 16, 300, 290, 10, 10),  # room for 15 rows: one chunk
    "one row": (1, 8, 5, 5, None, 1),
    "long rows": (6, 8, 4100, 4097, 4, 3),  # two 4096-column tiles; chunks of 3
}


def keep_budget(case: str, dtype: torch.dtype) -> float:
    n, _, v, _, _, kept = CASES[case]
    rows = 15 if case == "budget between chunks" else kept
    return gib_for_rows(rows, v, dtype)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_kept_equals_recomputed(backend: str, dtype: torch.dtype, case: str,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    n, e, v, n_valid, chunk, kept = CASES[case]
    inp = make_inputs(n, e, v, n_valid, dtype, bias=True, seed=n + v)
    built: list[tuple[int, bool]] = []  # (rows, into the kept buffer) per logits GEMM
    real = ce._logits

    def spy(h, w, b, out=None):  # noqa: ANN001, ANN202
        built.append((h.shape[0], out is not None))
        return real(h, w, b, out)

    monkeypatch.setattr(ce, "_logits", spy)
    recomputed = run_ours(inp, n_valid, backend, chunk)
    forward_chunks = len(tiles.row_chunks(0, n, chunk or n))
    assert len(built) == 2 * forward_chunks and not any(k for _, k in built)
    built.clear()
    ours = run_ours(inp, n_valid, backend, chunk, keep_logits_gib=keep_budget(case, dtype))
    # forward: every chunk, the first `kept` rows into the kept buffer; backward (one
    # vocabulary block here): only the chunks beyond them
    assert sum(rows for rows, into in built if into) == kept
    assert sum(rows for rows, _ in built) == n + (n - kept)
    # the forward is the same arithmetic: bitwise equal losses and flags
    assert torch.equal(ours[0], recomputed[0]) and torch.equal(ours[1], recomputed[1])
    # backward: the same tiles, read from the kept buffer instead of recomputed by the same
    # GEMM (one vocabulary block): the same bits
    for a, b in zip(ours[2], recomputed[2], strict=True):
        assert torch.equal(a, b)
    assert_matches(ours, full_logits_reference(**inp, n_valid=n_valid), dtype)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_and_recomputed_across_vocabulary_blocks(backend: str, dtype: torch.dtype,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """64-row vocabulary blocks (one partly padding, one all padding, a short last one), a
    shard starting at id 1000, 2 of 4 row chunks kept: tiles are strided views of the kept
    buffer. Recomputed tiles come from a GEMM of another shape, so equal within tolerance."""
    monkeypatch.setattr(tiles, "CHUNK_ELEMENTS", 64 * 16)  # fp32 block of 64 x E=16
    inp = make_inputs(29, 16, 300, 200, dtype, bias=True, seed=4)
    assert [c.stop - c.start for c in tiles.row_chunks(0, 29, 8)] == [8, 7, 7, 7]
    kept = run_ours(inp, 200, backend, 8, vocab_start=1000,
                    keep_logits_gib=gib_for_rows(15, 300, dtype))
    recomputed = run_ours(inp, 200, backend, 8, vocab_start=1000)
    assert torch.equal(kept[0], recomputed[0])
    assert_matches(kept, recomputed, dtype)
    assert_matches(kept, full_logits_reference(**inp, n_valid=200), dtype)
    assert (kept[2][1][200:] == 0).all() and (kept[2][2][200:] == 0).all()


def test_default_tiling_keeps_with_the_backward_chunks_it_picks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Default tiling: 16-row forward chunks, 64-row backward chunks (budget 2^10 elements at
    V = 64, blocks of 64): the kept rows are chunked again for backward."""
    monkeypatch.setattr(tiles, "CHUNK_ELEMENTS", 2**10)
    assert tiles.choose_tiling(64, 16, None) == tiles.Tiling(16, 16, 64)
    monkeypatch.setattr(tiles, "CHUNK_ELEMENTS", 2**12)
    assert tiles.choose_tiling(64, 16, None) == tiles.Tiling(64, 64, 64)
    inp = make_inputs(100, 16, 64, 60, torch.float32, bias=False, seed=9)
    ref = full_logits_reference(**inp, n_valid=60)
    for rows in (32, 64, 100):  # kept: half a backward chunk, one, all
        ours = run_ours(inp, 60, "torch", None, keep_logits_gib=gib_for_rows(rows, 64,
                                                                              torch.float32))
        assert_matches(ours, ref, torch.float32)


def test_second_backward_through_kept_logits_is_refused() -> None:
    inp = make_inputs(9, 8, 40, 40, torch.float32, bias=True)
    h = inp["hidden"].clone().requires_grad_()
    losses, _ = ce.linear_cross_entropy(h, inp["weight"], inp["bias"], inp["targets"],
                                        inp["weights"], vocab_start=0, n_valid=40,
                                        keep_logits_gib=1.0)
    losses.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="keep_logits_gib=0"):
        losses.sum().backward()
    # recomputing, a second backward adds the same gradient again
    h2 = inp["hidden"].clone().requires_grad_()
    losses, _ = ce.linear_cross_entropy(h2, inp["weight"], inp["bias"], inp["targets"],
                                        inp["weights"], vocab_start=0, n_valid=40)
    losses.sum().backward(retain_graph=True)
    losses.sum().backward()
    torch.testing.assert_close(h2.grad, 2 * h.grad, atol=TOL[torch.float32][0], rtol=0)


def test_nothing_is_kept_without_a_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    kept: list[bool] = []
    real = ce._logits

    def spy(h, w, b, out=None):  # noqa: ANN001, ANN202
        kept.append(out is not None)
        return real(h, w, b, out)

    monkeypatch.setattr(ce, "_logits", spy)
    inp = make_inputs(9, 8, 40, 40, torch.float32, bias=True)
    args = (inp["hidden"], inp["weight"], inp["bias"], inp["targets"], inp["weights"])
    with torch.no_grad():  # e.g. validation
        ce.linear_cross_entropy(*args, vocab_start=0, n_valid=40, keep_logits_gib=1.0)
    ce.linear_cross_entropy(*args, vocab_start=0, n_valid=40, keep_logits_gib=1.0)  # no grad
    assert kept == [False, False]
