"""How the fused loss (kernels/cross_entropy.py) cuts its work into tiles, per device.

Forward: row chunks of at most `forward_rows` rows x all V_local columns. Backward: tiles of
at most `backward_rows` rows x `vocab_block` vocabulary rows. Row counts come from a budget of
elements per tile, CHUNK_ELEMENTS on CPU and CUDA_CHUNK_ELEMENTS on CUDA; the vocabulary
block from CHUNK_ELEMENTS on both (it bounds the fp32 grad_weight block). N rows are split
into equal chunks. `kept_rows` says how many rows' logits a GiB budget keeps for backward.
Pure arithmetic (no torch): the memory estimate can use it too. See docs/kernels.md.
"""

from __future__ import annotations

from typing import NamedTuple

# Memory budget, in elements, of the fp32 grad_weight block (vocabulary rows x E) on every
# device, and of a row chunk's logits tile on CPU: 2^25 = 128 MiB in fp32 (64 MiB in bf16).
# With V_local = 250,300 that is at most 128 rows per forward chunk on CPU, and vocabulary
# blocks of 20,160 rows at E = 1664.
CHUNK_ELEMENTS = 2**25
# Budget of a row chunk's logits tile on CUDA: 2^29 elements (1 GiB in bf16). At V_local =
# 250,368 that is 2,144 rows: rembert's micro-batch (16 x 77 = 1,232 masked rows) is one
# forward chunk, whose GEMM (1,232 x 1664 x 250k) is compute-bound, and whose kernels launch
# 1,232 row programs (9 per SM of an H200). 128-row chunks re-read the 0.8 GiB weight once per
# chunk (a memory-bound GEMM) and launch 128 programs for 132 SMs. See docs/kernels.md.
CUDA_CHUNK_ELEMENTS = 2**29
ROW_MULTIPLE = 16  # chunk budgets in rows are rounded down to a multiple of 16
GIB = 2**30


class Tiling(NamedTuple):
    forward_rows: int  # at most this many rows per forward chunk (tile: rows x V_local)
    backward_rows: int  # at most this many rows per backward chunk (tile: rows x vocab_block)
    vocab_block: int  # vocabulary rows per backward block (fp32 grad_weight: block x E)


def _rows_within(budget: int, width: int) -> int:
    """Rows of `width` elements that fit in `budget`, rounded down to ROW_MULTIPLE, >= 1."""
    rows = budget // max(width, 1)
    return max(1, rows // ROW_MULTIPLE * ROW_MULTIPLE if rows >= ROW_MULTIPLE else rows)


def default_chunk_size(v_local: int, budget: int | None = None) -> int:
    """Rows per chunk so that one logits chunk holds at most `budget` (CHUNK_ELEMENTS)
    elements."""
    return _rows_within(budget or CHUNK_ELEMENTS, v_local)


def default_vocab_block(v_local: int, e: int, budget: int | None = None) -> int:
    """Vocabulary rows per backward block so that its fp32 grad_weight accumulator
    (block x E) holds at most `budget` (CHUNK_ELEMENTS) elements."""
    return max(1, min(v_local, _rows_within(budget or CHUNK_ELEMENTS, e)))


def choose_tiling(v_local: int, e: int, chunk_size: int | None, budget: int | None = None,
                  cuda: bool = False) -> Tiling:
    """An explicit chunk_size is the most rows per chunk of both passes. By default each pass
    takes as many rows as fit a row budget at its tile width: CHUNK_ELEMENTS (`budget`) on
    CPU, CUDA_CHUNK_ELEMENTS on CUDA (larger GEMMs and more row programs for a large GPU).
    Backward tiles are narrower (vocab_block < V_local for large vocabularies), so they take
    more rows. The vocabulary block is CHUNK_ELEMENTS // E on every device: it bounds the
    fp32 grad_weight block, which exists whenever several row chunks add into one block."""
    block = default_vocab_block(v_local, e, budget)
    if chunk_size:
        return Tiling(chunk_size, chunk_size, block)
    rows_budget = CUDA_CHUNK_ELEMENTS if cuda else budget
    return Tiling(default_chunk_size(v_local, rows_budget), default_chunk_size(block, rows_budget),
                  block)


def row_chunks(start: int, stop: int, max_rows: int) -> list[slice]:
    """Rows start .. stop in the fewest chunks of at most `max_rows`, of equal sizes (within
    one row of each other): 1,232 rows at 128 a chunk are 10 chunks of 123-124, not 9 of 128
    and one of 80."""
    n = stop - start
    if n <= 0:
        return []
    count = -(-n // max_rows)
    size, longer = divmod(n, count)  # the first `longer` chunks take one row more
    bounds = [start + i * size + min(i, longer) for i in range(count + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]


def kept_rows(chunks: list[slice], v_local: int, itemsize: int, keep_logits_gib: float) -> int:
    """Rows whose forward logits are kept for backward: those of the first whole chunks whose
    logits (rows x V_local, `itemsize` bytes each) fit in `keep_logits_gib` GiB together."""
    rows = 0
    for chunk in chunks:
        if chunk.stop * v_local * itemsize > keep_logits_gib * GIB:
            break
        rows = chunk.stop
    return rows


def recomputed_rows(n: int, v_local: int, e: int, itemsize: int, keep_logits_gib: float,
                    chunk_size: int | None = None, cuda: bool = False) -> int:
    """Of n rows, how many the backward recomputes the logits of (the others were kept): for
    FLOP models (each recomputed row costs one more 2 x E x V_local forward GEMM row)."""
    forward = row_chunks(0, n, choose_tiling(v_local, e, chunk_size, cuda=cuda).forward_rows)
    return n - kept_rows(forward, v_local, itemsize, keep_logits_gib)
