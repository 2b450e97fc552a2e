"""MLM output layer fused with softmax cross-entropy, for ONE vocabulary shard.

    logits = hidden @ weight.T + bias            (never held for all rows at once, unless kept)
    loss_i = logsumexp_global(logits_i) - logits_i[target_i]

Every one of the N rows is computed, at static shapes: nothing here reads a value back to the
host (no nonzero, no boolean indexing, no .item()), so on a GPU the host never waits for the
device. Rows with weight 0 are masked explicitly (`torch.where`): loss exactly 0, never
correct, and in backward a softmax of exactly 0 (their logsumexp set to +inf) with no target
(id -1, in no shard) and an upstream gradient of 0, so they add exactly 0 to every gradient
whatever their target id.

Forward, per chunk of rows (`Tiling.forward_rows`, N split into equal chunks):
  1. logits chunk by one matmul in the input dtype (the GEMM accumulates in fp32);
  2. a Triton kernel (or its torch reference) reads it once and writes per row the shard max
     m_r, the sum-exp s_r relative to m_r, and the target logit t_r (0 if not in the shard).
  The first chunks whose logits fit in `keep_logits_gib` are written into one kept buffer
  (kept rows x V_local) and saved for backward; the others are freed.
Then, once per call, the cross-shard combination through the injected callables:
     M = reduce_max(m);  [S, T] = reduce_sum([s * exp(m - M), t]);  lse = log S + M
That is 2 collectives per call, whatever N, on 1 x N and 2 x N fp32 tensors.
Backward works in tiles of (row chunk) x (vocabulary block): the saved per-row global
logsumexp makes each block's gradient independent of the others. Per vocabulary block, per
row chunk: take the tile's logits (a view of the kept buffer, or recomputed by one GEMM),
overwrite them in place with grad_out * (softmax - onehot) (a second kernel), and add the
tile's products into fp32 accumulators: the block's grad_weight (block x E), grad_hidden
(N x E) and grad_bias. So no gradient is ever summed in bf16, and no V_local x E fp32 buffer
exists. Saved for backward: hidden, weight, bias, targets, the per-row global logsumexp and
the kept logits (at most `keep_logits_gib`). No collective in backward: grad_hidden is this
shard's contribution; the caller all-reduces it over tensor parallel.

Columns >= n_valid of the shard are vocabulary padding: -inf logits, zero probability.
See docs/kernels.md for the tiling rule per device and the memory math.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from megatron_rembert.kernels.aot import FLOAT_TYPES, KernelConfig, kernel_config
from megatron_rembert.kernels.cross_entropy_tiling import (
    Tiling,
    choose_tiling,
    kept_rows,
    row_chunks,
)

try:  # triton is optional: the torch path must work where it is missing (e.g. macOS)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None

Reduce = Callable[[torch.Tensor], None]  # in-place all-reduce over the tensor-parallel group

# Column tile of the Triton kernels: each program loops over its row in tiles of this width.
BLOCK_V_MAX = 4096
NUM_WARPS = 8  # per row program: a 4096-column tile is 16 values per thread
# Narrowest tile: one column per thread. A narrower one would only leave threads idle, and
# every distinct tile width is one more kernel to compile (and to check in CI).
BLOCK_V_MIN = 32 * NUM_WARPS
# Stand-in for -inf as the running max of a row with no valid column yet: keeps
# exp(m_old - m_new) finite (exp(-inf - -inf) would be NaN) and still exp(x - NEG_BIG) = 0.
NEG_BIG = -1e30

if triton is not None:
    # The kernels' copy: compiled kernels may read only tl.constexpr globals (the interpreter
    # also accepts a plain float; the compiler refuses it, see docs/kernels.md).
    _NEG_BIG_K = tl.constexpr(NEG_BIG)

    @triton.jit
    def _ce_stats_kernel(
        logits_ptr, stride, targets_ptr, max_ptr, sumexp_ptr, target_logit_ptr,
        vocab_start, n_valid, BLOCK_V: tl.constexpr,
    ):
        """Per row: online max / sum-exp over the valid columns, and the target logit."""
        row = tl.program_id(0).to(tl.int64)
        target = tl.load(targets_ptr + row) - vocab_start  # local column of the target
        row_max = tl.full((), _NEG_BIG_K, tl.float32)
        sumexp = tl.zeros((), tl.float32)
        target_logit = tl.zeros((), tl.float32)
        for start in range(0, n_valid, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            valid = cols < n_valid
            x = tl.load(logits_ptr + row * stride + cols, mask=valid, other=float("-inf"))
            x = x.to(tl.float32)
            new_max = tl.maximum(row_max, tl.max(x, axis=0))
            sumexp = sumexp * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            row_max = new_max
            target_logit += tl.sum(tl.where(valid & (cols == target), x, 0.0), axis=0)
        tl.store(max_ptr + row, row_max)
        tl.store(sumexp_ptr + row, sumexp)
        tl.store(target_logit_ptr + row, target_logit)

    @triton.jit
    def _ce_grad_kernel(
        logits_ptr, stride, targets_ptr, lse_ptr, grad_out_ptr,
        vocab_start, n_valid, n_cols, BLOCK_V: tl.constexpr,
    ):
        """Overwrite a row of logits with grad_out * (softmax - onehot); padding gets 0."""
        row = tl.program_id(0).to(tl.int64)
        target = tl.load(targets_ptr + row) - vocab_start
        lse = tl.load(lse_ptr + row)
        g = tl.load(grad_out_ptr + row)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            in_row = cols < n_cols
            x = tl.load(logits_ptr + row * stride + cols, mask=in_row, other=0.0)
            p = tl.where(cols < n_valid, tl.exp(x.to(tl.float32) - lse), 0.0)
            p = tl.where((cols == target) & (cols < n_valid), p - 1.0, p)
            out = (p * g).to(logits_ptr.dtype.element_ty)
            tl.store(logits_ptr + row * stride + cols, out, mask=in_row)


# ---------------------------------------------------------------- per-chunk ops: torch
def chunk_stats_torch(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, n_valid: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of the stats kernel. logits: C x V_local; targets: C global ids.

    Returns fp32 (max, sum-exp relative to max, target logit or 0), each of length C.
    """
    C = logits.shape[0]
    x = logits[:, :n_valid].float()  # C x n_valid
    if n_valid == 0:  # a shard made only of padding: no mass, no target
        zeros = x.new_zeros(C)  # C
        return x.new_full((C,), NEG_BIG), zeros, zeros.clone()
    row_max = x.amax(dim=1).clamp(min=NEG_BIG)  # C
    sumexp = (x - row_max[:, None]).exp_().sum(dim=1)  # C (one C x n_valid temporary)
    local = targets - vocab_start  # C
    in_shard = (local >= 0) & (local < n_valid)  # C
    picked = x.gather(1, local.clamp(0, n_valid - 1)[:, None]).squeeze(1)  # C
    return row_max, sumexp, torch.where(in_shard, picked, torch.zeros_like(picked))


def chunk_grad_torch_(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
    vocab_start: int, n_valid: int,
) -> None:
    """Reference of the gradient kernel: logits (C x V_local) <- g * (softmax - onehot).

    Static shapes: every row adds -1 or -0 at its target's column (clamped into the row when
    the target is in another shard), which leaves the others' p unchanged bit for bit."""
    C, V = logits.shape
    if V == 0:
        return
    p = logits.float()  # C x V_local, fp32: logits itself when fp32, else one copy
    p.sub_(lse[:, None]).exp_()
    p[:, n_valid:] = 0.0
    local = targets - vocab_start  # C
    in_shard = (local >= 0) & (local < n_valid)  # C
    p.scatter_add_(1, local.clamp(0, V - 1)[:, None], -in_shard.to(p.dtype)[:, None])
    logits.copy_(p.mul_(grad_out[:, None]))


# ---------------------------------------------------------------- per-chunk ops: Triton
def _block_v(n: int) -> int:
    """Column tile of both launchers for a row of n columns."""
    return max(BLOCK_V_MIN, min(BLOCK_V_MAX, triton.next_power_of_2(max(n, 1))))


def aot_configs() -> list[KernelConfig]:
    """Every kernel configuration the launchers below can choose, for the AOT compile test."""
    configs = []
    for block in sorted({_block_v(n) for n in range(BLOCK_V_MAX + 1)}):  # constant above
        for dt in FLOAT_TYPES.values():
            configs.append(kernel_config(
                _ce_stats_kernel, NUM_WARPS,
                {"logits_ptr": f"*{dt}", "stride": "i32", "targets_ptr": "*i64",
                 "max_ptr": "*fp32", "sumexp_ptr": "*fp32", "target_logit_ptr": "*fp32",
                 "vocab_start": "i32", "n_valid": "i32"},
                BLOCK_V=block,
            ))
            configs.append(kernel_config(
                _ce_grad_kernel, NUM_WARPS,
                {"logits_ptr": f"*{dt}", "stride": "i32", "targets_ptr": "*i64",
                 "lse_ptr": "*fp32", "grad_out_ptr": "*fp32", "vocab_start": "i32",
                 "n_valid": "i32", "n_cols": "i32"},
                BLOCK_V=block,
            ))
    return configs


def chunk_stats_triton(logits, targets, vocab_start, n_valid):  # noqa: ANN001, ANN201
    C = logits.shape[0]
    out = torch.empty(3, C, dtype=torch.float32, device=logits.device)  # 3 x C
    if C:
        _ce_stats_kernel[(C,)](
            logits, logits.stride(0), targets, out[0], out[1], out[2], vocab_start, n_valid,
            BLOCK_V=_block_v(n_valid), num_warps=NUM_WARPS,
        )
    return out[0], out[1], out[2]


def chunk_grad_triton_(logits, targets, lse, grad_out, vocab_start, n_valid):  # noqa: ANN001
    C, V = logits.shape
    if C:
        _ce_grad_kernel[(C,)](
            logits, logits.stride(0), targets, lse, grad_out, vocab_start, n_valid, V,
            BLOCK_V=_block_v(V), num_warps=NUM_WARPS,
        )


# ---------------------------------------------------------------- autograd Function
def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """C x E @ (V_local x E).T (+ bias) -> C x V_local in the input dtype (into `out`)."""
    if bias is not None:
        return torch.addmm(bias, h, weight.t(), out=out)
    return torch.mm(h, weight.t(), out=out)


class _Saved(NamedTuple):
    """What backward reads."""
    h: torch.Tensor  # N x E
    weight: torch.Tensor  # V_local x E
    bias: torch.Tensor | None  # V_local
    tgt: torch.Tensor  # N, global ids; -1 on weight-0 rows
    lse: torch.Tensor  # N fp32, global logsumexp; +inf on weight-0 rows
    g: torch.Tensor  # N fp32, upstream gradient of each loss; 0 on weight-0 rows
    kept: torch.Tensor  # kept x V_local, the forward logits of rows 0 .. kept
    vocab_start: int
    n_valid: int
    grad_rows: Callable  # chunk_grad_triton_ or chunk_grad_torch_
    # fp32 buffers (V_local x E, V_local) that grad_weight / grad_bias are added into instead
    # of returned: the trainer's main gradients; None: returned as usual
    into_weight: torch.Tensor | None = None
    into_bias: torch.Tensor | None = None


def _grad_logits(s: _Saved, rows: slice, cols: slice) -> torch.Tensor:
    """d(sum g * loss) / d logits of one tile: C x Vb in the input dtype, written over the
    kept logits (a strided view, row stride V_local) or over recomputed ones."""
    if rows.stop <= s.kept.shape[0]:
        dlogits = s.kept[rows, cols]  # C x Vb view: no GEMM
    else:
        bias = s.bias[cols] if s.bias is not None else None  # Vb
        dlogits = _logits(s.h[rows], s.weight[cols], bias)  # C x Vb
    n_valid = min(max(s.n_valid - cols.start, 0), cols.stop - cols.start)  # block's real cols
    s.grad_rows(dlogits, s.tgt[rows], s.lse[rows], s.g[rows], s.vocab_start + cols.start,
                n_valid)
    return dlogits


# Rows of a reduced-precision product made at once before it is added in fp32, on CPU: a
# 1024 x 1664 bf16 piece (3.3 MB) is added while it is still in cache. Measured per 20,000 x
# 1664 block of 307 rows (AMX CPU, bf16): 27.5 ms, against 58 ms for an fp32 GEMM of the
# upcast operands and 71 ms for the whole bf16 product then the add.
CPU_PRODUCT_ROWS = 1024


def product_rows(device: torch.device) -> int | None:
    """Rows per piece of a reduced-precision product summed in fp32 (see _add_product_): on
    CPU a piece that stays in cache; on a GPU the whole product (None)."""
    return CPU_PRODUCT_ROWS if device.type == "cpu" else None


def _add_product_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  piece_rows: int | None) -> None:
    """out += a @ b, `out` fp32 or of the operands' dtype. A reduced-precision product summed
    in fp32: the operands' own GEMM (which accumulates in fp32), rounded once to their dtype
    and added in fp32, on every device; on CPU `piece_rows` rows at a time."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
        return
    step = piece_rows or a.shape[0]
    piece = torch.empty(min(step, a.shape[0]), b.shape[1], dtype=a.dtype, device=a.device)
    for r0 in range(0, a.shape[0], step):
        rows = slice(r0, min(r0 + step, a.shape[0]))
        product = piece[:rows.stop - r0]
        torch.mm(a[rows], b, out=product)
        out[rows] += product


def _backward_tiles(s: _Saved, tiling: Tiling, need: tuple[bool, bool, bool]
                    ) -> tuple[torch.Tensor | None, ...]:
    """grad_h (N x E fp32), grad_w (V_local x E, weight dtype), grad_b (V_local fp32).

    Rows are chunked in two runs, the kept rows and the recomputed ones, so a chunk is either
    all kept or all recomputed. Every gradient is summed in fp32. In fp32 the GEMMs accumulate
    straight into the gradients (`addmm_`: no product tensor, no separate accumulator). In a
    reduced precision grad_weight is summed in an fp32 buffer per vocabulary block (or in the
    fp32 main gradient) and rounded once, so the error does not grow with the tile count; see
    _add_product_ for how each product reaches it. A block covered by one row chunk has one
    product: it goes straight into grad_weight, which is the same rounding.
    """
    (n, e), v_local, keep = s.h.shape, s.weight.shape[0], s.kept.shape[0]
    f32 = dict(dtype=torch.float32, device=s.h.device)
    exact = s.h.dtype == torch.float32  # fp32 products need no separate fp32 sum
    piece_rows = product_rows(s.h.device)
    grad_h = torch.zeros(n, e, **f32) if need[0] else None  # N x E, over blocks
    into_w, into_b = s.into_weight, s.into_bias  # main gradients: fp32 sums of their own
    grad_w = torch.empty_like(s.weight) if need[1] and into_w is None else None  # V_local x E
    grad_b = (into_b if into_b is not None
              else torch.zeros(v_local, **f32) if need[2] else None)  # V_local, fp32
    chunks = (row_chunks(0, keep, tiling.backward_rows)
              + row_chunks(keep, n, tiling.backward_rows)) or [slice(0, 0)]
    # one product per block, in the weight's dtype: grad_weight is written directly
    direct = exact or len(chunks) == 1
    for v0 in range(0, v_local, tiling.vocab_block):
        cols = slice(v0, min(v0 + tiling.vocab_block, v_local))
        # where this block's grad_weight is summed: the main gradient, grad_w, or fp32 Vb x E
        sum_w = into_w[cols] if into_w is not None else None
        if grad_w is not None:
            sum_w = grad_w[cols] if direct else torch.zeros(cols.stop - v0, e, **f32)
        for i, rows in enumerate(chunks):
            dlogits = _grad_logits(s, rows, cols)  # C x Vb
            if grad_h is not None:
                if exact:
                    grad_h[rows].addmm_(dlogits, s.weight[cols])  # C x E
                else:
                    grad_h[rows] += dlogits @ s.weight[cols]  # C x E
            if sum_w is not None:
                if i == 0 and grad_w is not None and direct:
                    torch.mm(dlogits.t(), s.h[rows], out=sum_w)  # Vb x E, first product
                else:
                    _add_product_(sum_w, dlogits.t(), s.h[rows], piece_rows)
            if grad_b is not None:
                grad_b[cols] += dlogits.sum(dim=0, dtype=torch.float32)  # Vb
        if grad_w is not None and not direct:
            grad_w[cols] = sum_w  # rounded once to the weight's dtype
    return grad_h, grad_w, grad_b


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, weights, vocab_start, n_valid,  # noqa: ANN001
                reduce_max, reduce_sum, tiling, use_triton, keep_logits_gib, main_grads,
                on_added):
        stats = chunk_stats_triton if use_triton else chunk_stats_torch
        n, v_local = hidden.shape[0], weight.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        active = weights != 0  # N, rows that carry loss
        tgt = torch.where(active, targets, -1)  # N; a weight-0 row's target: id -1, no shard's
        chunks = row_chunks(0, n, tiling.forward_rows)
        keep = kept_rows(chunks, v_local, hidden.element_size(), keep_logits_gib)
        kept = hidden.new_empty(keep, v_local)  # kept x V_local, saved for backward
        row_max = torch.empty(n, **f32)  # N
        sums = torch.empty(2, n, **f32)  # 2 x N
        for rows in chunks:
            logits = _logits(hidden[rows], weight, bias, kept[rows] if rows.stop <= keep else None)
            m, s, t = stats(logits, tgt[rows], vocab_start, n_valid)  # C x V_local -> 3 x C
            row_max[rows], sums[0, rows], sums[1, rows] = m, s, t
        local_max = row_max.clone()  # N
        if reduce_max is not None:
            reduce_max(row_max)  # row_max is now the global max M
        sums[0] *= torch.exp(local_max - row_max)  # s_r rescaled to the global max
        if reduce_sum is not None:
            reduce_sum(sums)  # [S, target logit] summed over shards
        lse = torch.log(sums[0]) + row_max  # N, global logsumexp
        losses = torch.where(active, lse - sums[1], 0.0)  # N
        correct = active & (sums[1] >= row_max)  # N
        # backward: exp(x - inf) = 0, so a weight-0 row's softmax is exactly 0
        lse = torch.where(active, lse, float("inf"))  # N
        ctx.save_for_backward(hidden, weight, bias, tgt, lse, active, kept)
        ctx.meta = (vocab_start, n_valid, tiling, use_triton, main_grads, on_added)
        ctx.kept_consumed = False
        ctx.mark_non_differentiable(correct)
        return losses, correct

    @staticmethod
    def backward(ctx, grad_losses, _grad_correct):  # noqa: ANN001
        # backward overwrites the kept logits with their gradient (autograd's version check
        # would refuse a second pass too, but without saying why)
        if ctx.kept_consumed:
            raise RuntimeError(
                "linear_cross_entropy: a second backward through a forward that kept its "
                "logits (keep_logits_gib > 0) would read their overwritten values; run that "
                "forward with keep_logits_gib=0 to backward through it twice")
        hidden, weight, bias, tgt, lse, active, kept = ctx.saved_tensors
        vocab_start, n_valid, tiling, use_triton, (into_weight, into_bias), on_added = ctx.meta
        ctx.kept_consumed = kept.shape[0] > 0
        g = torch.where(active, grad_losses.float(), 0.0)  # N
        saved = _Saved(hidden, weight, bias, tgt, lse, g, kept, vocab_start, n_valid,
                       chunk_grad_triton_ if use_triton else chunk_grad_torch_,
                       into_weight, into_bias)
        grad_h, grad_w, grad_b = _backward_tiles(saved, tiling, ctx.needs_input_grad[:3])
        if on_added is not None:
            on_added()  # the main gradients hold this backward's part
        grad_hidden = grad_h.to(hidden.dtype) if grad_h is not None else None  # N x E
        # a gradient added into its main gradient is not returned (None: autograd adds nothing)
        grad_b = None if grad_b is None or into_bias is not None else grad_b.to(bias.dtype)
        return grad_hidden, grad_w, grad_b, *([None] * 11)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    weights: torch.Tensor,
    *,
    vocab_start: int,
    n_valid: int,
    reduce_max: Reduce | None = None,
    reduce_sum: Reduce | None = None,
    chunk_size: int | None = None,
    keep_logits_gib: float = 0.0,
    main_grads: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    on_added: Callable[[], None] | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row softmax cross-entropy of `hidden @ weight.T + bias` over the global vocabulary.

    Args:
        hidden: N x E hidden states of the masked positions (fp32 / bf16 / fp16), identical on
            every rank of the tensor-parallel group.
        weight: V_local x E, this shard's rows vocab_start .. vocab_start + V_local of the
            padded output embedding; same dtype as hidden.
        bias: V_local or None.
        targets: N int64 GLOBAL vocabulary ids (valid ids wherever weights != 0; any value
            elsewhere).
        weights: N float; rows with weight 0 give loss 0, gradient 0 and are never correct.
            Every row is computed all the same (static shapes, no host sync).
        vocab_start: first global id of this shard.
        n_valid: columns n_valid .. V_local of this shard are padding (never take mass).
        reduce_max / reduce_sum: in-place all-reduce callables over the tensor-parallel group;
            None = single shard. Called exactly once each per forward, on an N and a 2 x N
            fp32 tensor.
        chunk_size: at most this many rows per chunk, forward and backward; default: the
            device's tiling (`choose_tiling`). Rows are split into equal chunks.
        keep_logits_gib: keep the logits of the first forward chunks that fit in this many
            GiB for backward, which then skips their recomputation (one GEMM of four); 0 =
            recompute every chunk. Only when a gradient is needed; a graph that kept logits
            can be backwarded once.
        main_grads: fp32 buffers of the shapes of weight and bias (the trainer's main
            gradients, parallel/grad_buffer.py) into which backward adds grad_weight and
            grad_bias, summed in fp32 without a rounding to the weight's dtype; autograd then
            gets no gradient for that tensor. None (each): returned as usual.
        on_added: called once backward has added into `main_grads` (the buffer's count of
            those gradients: autograd, handed none, cannot be relied on to report them).
        backend: "auto" (CUDA -> Triton, CPU -> torch), "triton" or "torch".

    Returns:
        losses: N fp32, per-row cross-entropy (0 where weight is 0).
        correct: N bool, target logit >= global max logit and weight != 0.
    The caller reduces `(losses * weights).sum()`; backward returns this shard's contribution
    to grad_hidden (to be all-reduced over TP by the caller), grad_weight and grad_bias.
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    use_triton = backend == "triton" or (
        backend == "auto" and hidden.is_cuda and triton is not None
    )
    if use_triton and triton is None:
        raise RuntimeError("backend='triton' needs the triton package; use backend='torch'")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden N x E and weight V_local x E, got {tuple(hidden.shape)} "
            f"and {tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(
            f"hidden, weight and bias must share one dtype, got {hidden.dtype}, "
            f"{weight.dtype}, {None if bias is None else bias.dtype}; cast them first"
        )
    if not 0 <= n_valid <= weight.shape[0]:
        raise ValueError(f"n_valid must be in [0, V_local={weight.shape[0]}], got {n_valid}")
    if targets.shape != (hidden.shape[0],) or weights.shape != (hidden.shape[0],):
        raise ValueError(f"targets and weights must have shape ({hidden.shape[0]},)")
    if chunk_size is not None and chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 1 rows, or None / 0 for the default, "
                         f"got {chunk_size}")
    if not (math.isfinite(keep_logits_gib) and keep_logits_gib >= 0):
        raise ValueError(f"keep_logits_gib must be a finite number >= 0 (0 = recompute the "
                         f"logits in backward), got {keep_logits_gib}")
    for into, like in zip(main_grads, (weight, bias), strict=True):
        if into is not None and (like is None or into.shape != like.shape
                                 or into.dtype != torch.float32):
            raise ValueError("main_grads must be fp32 tensors of the shapes of weight and bias")
    tiling = choose_tiling(weight.shape[0], weight.shape[1], chunk_size, cuda=hidden.is_cuda)
    # kept logits serve backward only: none under no_grad or without a parameter needing grad
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _LinearCrossEntropy.apply(
        hidden, weight.contiguous(), bias, targets.long(), weights, int(vocab_start),
        int(n_valid), reduce_max, reduce_sum, tiling, use_triton,
        float(keep_logits_gib) if grads else 0.0, tuple(main_grads), on_added,
    )
