"""linear_cross_entropy on one shard: Triton (interpreter) and torch paths against
F.cross_entropy on full logits, values and every gradient, fp32 and bf16, odd shapes."""

from __future__ import annotations

import pytest
import torch

from megatron_rembert.kernels import cross_entropy as ce
from megatron_rembert.kernels import cross_entropy_tiling as tiles
from tests.kernels.ce_oracle import TOL, full_logits_reference, make_inputs


def run_ours(inp: dict, n_valid: int, backend: str, chunk_size: int | None,  # noqa: ANN201
             vocab_start: int = 0, **kw):  # noqa: ANN003
    """The op on `inp` as a shard starting at global id `vocab_start`."""
    h = inp["hidden"].clone().requires_grad_()
    w = inp["weight"].clone().requires_grad_()
    b = inp["bias"].clone().requires_grad_() if inp["bias"] is not None else None
    losses, correct = ce.linear_cross_entropy(
        h, w, b, inp["targets"] + vocab_start, inp["weights"], vocab_start=vocab_start,
        n_valid=n_valid, chunk_size=chunk_size, backend=backend, **kw,
    )
    (losses * inp["grad_out"]).sum().backward()
    return losses.detach(), correct, [h.grad, w.grad, None if b is None else b.grad]


def assert_matches(ours, ref, dtype) -> None:  # noqa: ANN001
    atol, rtol = TOL[dtype]
    (l1, c1, g1), (l2, c2, g2) = ours, ref
    assert l1.dtype == torch.float32 and c1.dtype == torch.bool
    torch.testing.assert_close(l1, l2, atol=atol, rtol=rtol)
    assert torch.equal(c1, c2)
    for a, b in zip(g1, g2, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == dtype
            torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


# (N, E, V_local, n_valid, chunk_size): V not a multiple of the block, N not a multiple of the
# chunk, N = 1, V > one 4096-column tile, chunk larger than N, default chunk.
SHAPES = [
    (37, 16, 300, 290, 10),
    (1, 8, 5, 5, None),
    (6, 8, 4100, 4097, 4),
    (9, 24, 130, 100, 64),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_full_logits(backend: str, dtype: torch.dtype, shape: tuple) -> None:
    n, e, v, n_valid, chunk = shape
    inp = make_inputs(n, e, v, n_valid, dtype, bias=n % 2 == 1, seed=n + v)
    ref = full_logits_reference(**inp, n_valid=n_valid)
    ours = run_ours(inp, n_valid, backend, chunk)
    assert_matches(ours, ref, dtype)
    assert (ours[0][inp["weights"] == 0] == 0).all()
    assert (ours[2][0][inp["weights"] == 0] == 0).all()  # no gradient from weight-0 rows
    assert (ours[2][1][n_valid:] == 0).all()  # padding columns take no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_equals_torch_reference(dtype: torch.dtype) -> None:
    inp = make_inputs(21, 16, 333, 321, dtype, bias=True, seed=5)
    a = run_ours(inp, 321, "triton", 8)
    b = run_ours(inp, 321, "torch", 8)
    assert_matches(a, b, dtype)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_row_max_in_a_later_tile(backend: str) -> None:
    """The online max/sum-exp must rescale when a later 4096-column tile holds the max."""
    inp = make_inputs(5, 8, 4200, 4150, torch.float32, bias=True, seed=3)
    inp["bias"][4096:4150] += 6.0  # the max of every row lies in the second tile
    inp["targets"][inp["weights"] != 0] = 4100  # ...and so does the target
    ref = full_logits_reference(**inp, n_valid=4150)
    assert_matches(run_ours(inp, 4150, backend, 3), ref, torch.float32)


def test_all_rows_weight_zero() -> None:
    inp = make_inputs(4, 8, 50, 50, torch.float32, bias=True, zero_frac=1.1)
    losses, correct, grads = run_ours(inp, 50, "triton", 2)
    assert (losses == 0).all() and not correct.any()
    assert all((g == 0).all() for g in grads)


def test_chunks_bound_the_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = ce._logits

    def spy(h, w, b, out=None):  # noqa: ANN001, ANN202
        seen.append(h.shape[0])
        return real(h, w, b, out)

    monkeypatch.setattr(ce, "_logits", spy)
    inp = make_inputs(23, 8, 40, 40, torch.float32, bias=False, zero_frac=0.0)
    run_ours(inp, 40, "torch", 5)
    # 5 equal chunks (5,5,5,4,4) in forward, the same 5 recomputed in backward
    assert seen == [5, 5, 5, 4, 4] * 2


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_backward_vocabulary_blocks(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Backward in 64-row vocabulary blocks: block 3 is partly padding, block 4 all padding,
    the last one short, and the shard starts at global id 1000."""
    monkeypatch.setattr(tiles, "CHUNK_ELEMENTS", 64 * 16)  # fp32 block of 64 x E=16
    assert tiles.choose_tiling(300, 16, 7) == tiles.Tiling(7, 7, 64)
    inp = make_inputs(19, 16, 300, 200, torch.float32, bias=True, seed=4)
    ref = full_logits_reference(**inp, n_valid=200)
    ours = run_ours(inp, 200, backend, 7, vocab_start=1000)
    assert_matches(ours, ref, torch.float32)
    assert (ours[2][1][200:] == 0).all() and (ours[2][2][200:] == 0).all()


def test_two_collectives_per_forward_none_in_backward() -> None:
    calls: list[tuple[str, tuple]] = []
    inp = make_inputs(30, 8, 64, 60, torch.float32, bias=True, zero_frac=0.3)
    ours = run_ours(
        inp, 60, "torch", 7,
        reduce_max=lambda t: calls.append(("max", tuple(t.shape))),
        reduce_sum=lambda t: calls.append(("sum", tuple(t.shape))),
    )
    assert calls == [("max", (30,)), ("sum", (2, 30))]  # every row, weight 0 or not
    assert_matches(ours, full_logits_reference(**inp, n_valid=60), torch.float32)


def test_default_chunk_size() -> None:
    assert tiles.default_chunk_size(250_300) == 128  # 2^25 / 250,300 = 134 -> 128
    assert tiles.default_chunk_size(125_150) * 125_150 <= tiles.CHUNK_ELEMENTS
    assert tiles.default_chunk_size(2**26) == 1


def test_default_tiling_keeps_every_buffer_within_the_budget() -> None:
    # RemBERT at TP = 1 on CPU: fp32 grad_weight blocks of 20,160 x 1664 (2^25 / 1664 =
    # 20,164), 13 of them; backward tiles of 1664 rows x 20,160 columns
    tiling = tiles.choose_tiling(250_300, 1664, None)
    assert tiling == tiles.Tiling(128, 1664, 20_160)
    assert tiling.vocab_block * 1664 <= tiles.CHUNK_ELEMENTS
    assert tiling.backward_rows * tiling.vocab_block <= tiles.CHUNK_ELEMENTS
    assert tiles.choose_tiling(300, 16, None) == tiles.Tiling(111_840, 111_840, 300)  # one block
    assert tiles.choose_tiling(250_300, 1664, 5) == tiles.Tiling(5, 5, 20_160)  # rows as asked


def test_cuda_tiling_takes_rembert_micro_batch_in_one_chunk() -> None:
    """On CUDA the row budget is 2^29 elements: 2,144 rows at the padded rembert shard, so
    16 x 77 = 1,232 masked rows are one forward chunk; the fp32 grad_weight block keeps the
    CPU bound (2^25 elements); an explicit chunk size wins on every device."""
    tiling = tiles.choose_tiling(250_368, 1664, None, cuda=True)
    assert tiling == tiles.Tiling(2144, 26_624, 20_160)
    assert tiling.forward_rows * 250_368 <= tiles.CUDA_CHUNK_ELEMENTS
    assert tiling.backward_rows * tiling.vocab_block <= tiles.CUDA_CHUNK_ELEMENTS
    assert tiles.row_chunks(0, 16 * 77, tiling.forward_rows) == [slice(0, 1232)]
    assert tiles.choose_tiling(125_184, 1664, None, cuda=True).forward_rows == 4288  # TP = 2
    assert tiles.choose_tiling(250_368, 1664, 512, cuda=True) == tiles.Tiling(512, 512, 20_160)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 1232, 8193])
@pytest.mark.parametrize("max_rows", [1, 7, 16, 128, 2144])
def test_row_chunks_are_equal_and_cover_the_rows(n: int, max_rows: int) -> None:
    chunks = tiles.row_chunks(3, 3 + n, max_rows)
    sizes = [c.stop - c.start for c in chunks]
    assert chunks[0].start == 3 and chunks[-1].stop == 3 + n
    assert all(a.stop == b.start for a, b in zip(chunks, chunks[1:], strict=False))
    assert len(chunks) == -(-n // max_rows)  # as few as the maximum allows
    assert max(sizes) <= max_rows and max(sizes) - min(sizes) <= 1
    assert tiles.row_chunks(5, 5, max_rows) == []


def test_kept_rows_are_whole_chunks_within_the_budget() -> None:
    chunks = tiles.row_chunks(0, 1232, 128)  # 124, 124, then 8 of 123 rows
    row_bytes = 250_368 * 2  # bf16 logits of one row
    assert tiles.kept_rows(chunks, 250_368, 2, 1.0) == 1232  # 0.57 GiB: all kept
    assert tiles.kept_rows(chunks, 250_368, 2, 0.0) == 0
    budget = 500 * row_bytes / 2**30  # room for 500 rows: the first 4 chunks (494 rows)
    assert tiles.kept_rows(chunks, 250_368, 2, budget) == chunks[3].stop == 494


def test_bad_arguments_are_explained() -> None:
    inp = make_inputs(3, 8, 10, 10, torch.float32, bias=False)
    args = (inp["hidden"], inp["weight"], None, inp["targets"], inp["weights"])
    with pytest.raises(ValueError, match="n_valid"):
        ce.linear_cross_entropy(*args, vocab_start=0, n_valid=11)
    with pytest.raises(ValueError, match="dtype"):
        ce.linear_cross_entropy(inp["hidden"].bfloat16(), *args[1:], vocab_start=0, n_valid=10)
    with pytest.raises(ValueError, match="backend"):
        ce.linear_cross_entropy(*args, vocab_start=0, n_valid=10, backend="cuda")
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="keep_logits_gib"):
            ce.linear_cross_entropy(*args, vocab_start=0, n_valid=10, keep_logits_gib=bad)
