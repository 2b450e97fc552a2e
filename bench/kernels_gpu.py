"""Correctness and speed of the Triton kernels on a CUDA GPU (needs only torch + triton).

    python -m bench.kernels_gpu [--dtype fp32,bf16] [--time-dtype bf16] [--no-timing]
                                [--rows 8192] [--vocab 250300] [--e 1664]
                                [--loss-chunks 0,512,1024,2048]
                                [--micro 16] [--predictions 77]
                                [--head-chunks 0,128,256,512,1024,2048] [--head-keep 0,1]

Checks, for every dtype of --dtype (default fp32 and bf16), each printed PASS or FAIL:
  softmax  the Triton path against the torch reference (fully masked rows included) and
           against eager torch.softmax: probabilities and the input gradient, 4 shapes;
  loss     the Triton path against the torch reference path (the same matmuls, so this
           isolates the kernels) and against F.cross_entropy on the full fp32 logits: losses,
           grad hidden / weight / bias, and the `correct` flags (exact); with half the
           logits kept for backward against F.cross_entropy too; on the --rows x
           --vocab problem and on a small one with padding columns, weight-0 rows and rows
           longer than one 4096-column tile.
The error of a tensor is max|ours - ref| / max|ref|, against TOLERANCE[dtype]. The exit
status is 1 if any check fails, so an acceptance script can rely on it.
Then, for --time-dtype only, forward + backward time (triton.testing.do_bench, median ms) of
  softmax: ours (Triton) | torch eager | torch.compile | SDPA (whole attention, for scale)
  loss:    ours (Triton, chunked) | torch eager full logits | torch.compile full logits;
           ours also at each --loss-chunks rows per chunk (0: the device's default tiling,
           2,144 rows at V 250,300 on CUDA; 128 before: on an H200 that ran 2.3x slower than
           compiled full logits, a 128-row matmul leaving most of a large GPU idle)
  head:    the rembert MLM head + loss (dense, GELU, LayerNorm, the 250k output embedding
           and the fused loss, model/mlm_head.py) at the micro-batch shape, --micro x
           --predictions masked rows (16 x 77 = 1,232), at each --head-chunks rows per chunk
           (0: the device's default) x each --head-keep GiB of kept logits (0: recompute in
           backward), each with its extra peak memory; eager and torch.compile of the head
           on full logits; and one Transformer layer of the rembert preset, --micro x 512
           tokens, so that every line reads "head = X layers" (goal: <= 2.5 layers, extra
           peak <= 2x that of 128 rows recomputed, the loss before this tiling)
Exits with a message (status 1) when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch
import torch.nn.functional as F

from bench.common import relative_error, write_json
from megatron_rembert.config import get_preset
from megatron_rembert.kernels.cross_entropy import linear_cross_entropy
from megatron_rembert.kernels.cross_entropy_tiling import recomputed_rows
from megatron_rembert.kernels.softmax import (
    fused_scale_mask_softmax,
    softmax_backward_torch,
    softmax_forward_torch,
)
from megatron_rembert.model.mlm_head import MLMHead
from megatron_rembert.model.transformer import TransformerLayer
from megatron_rembert.parallel.layers import init_weights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# Worst max|ours - ref| / max|ref| of a tensor. Both sides do their math in fp32 on the same
# inputs: in fp32 they differ only in summation order and exp rounding (~1e-6); in bf16 / fp16
# also in where a result is rounded to the dtype, a few ulps at most (ulp 2^-8 / 2^-11 relative).
# A real bug (wrong column, missing rescale, lost row) gives errors of order 1.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
SOFTMAX_SHAPES = [(8, 16, 128), (4, 16, 512), (2, 16, 1000), (2, 4, 4096)]  # B x H x S (= Sk)
# Where the checks run and which path is "ours": tests/kernels/test_kernels_gpu_bench.py runs
# them on CPU with the Triton interpreter (DEVICE "cpu", BACKEND "triton").
DEVICE, BACKEND = "cuda", "auto"
# Without CUDA it refuses with one line; its checks also run as tests (pytest -m gpu).
NEEDS_CUDA = True
# The smallest run: the checks at small sizes, no timing (tests/bench/test_every_bench.py).
TINY_ARGS = ["--no-timing", "--rows", "64", "--vocab", "4133", "--e", "64"]


class Checks:
    """Prints one PASS / FAIL line per check and remembers the failures."""

    def __init__(self) -> None:
        self.total, self.failed = 0, []

    def close(self, name: str, ours: dict, ref: dict, dtype: torch.dtype) -> None:
        errors = {k: relative_error(ours[k], ref[k]) for k in ref}
        ok = all(e <= TOLERANCE[dtype] for e in errors.values())
        detail = " ".join(f"{k} {e:.1e}" for k, e in errors.items())
        self.record(name, ok, f"{detail} (tol {TOLERANCE[dtype]:.0e})")

    def record(self, name: str, ok: bool, detail: str) -> None:
        self.total += 1
        if not ok:
            self.failed.append(name)
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)


def outputs_and_grads(fn, inputs: dict[str, torch.Tensor], seed: int = 0) -> dict:  # noqa: ANN001
    """{"out": fn(**inputs), "d<name>": gradient of sum(out * random)} (out = first output)."""
    for t in inputs.values():
        t.grad = None
    out = fn(**inputs)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.randn(out.shape, generator=torch.Generator(out.device).manual_seed(seed),
                    device=out.device)
    (out.float() * g).sum().backward()
    return {"out": out.detach()} | {f"d{k}": t.grad for k, t in inputs.items()}


# ---------------------------------------------------------------- correctness
def check_softmax(dtype: torch.dtype, checks: Checks, shapes: list = SOFTMAX_SHAPES) -> None:
    for B, H, S in shapes:
        gen = torch.Generator(DEVICE).manual_seed(S)
        x = (torch.randn(B, H, S, S, device=DEVICE, generator=gen) * 3).to(dtype)
        x.requires_grad_()
        mask = torch.rand(B, S, device=DEVICE, generator=gen) > 0.1  # B x S
        mask[-1] = False  # the last batch entry has no key: zeros, not NaN
        scale = 64**-0.5

        def ours(x, mask=mask, scale=scale):  # noqa: ANN001, ANN202
            return fused_scale_mask_softmax(x, mask, scale, backend=BACKEND)  # CUDA: Triton

        def reference(x, mask=mask, scale=scale):  # noqa: ANN001, ANN202
            return _SoftmaxReference.apply(x, mask, scale)

        def eager(x, mask=mask, scale=scale):  # noqa: ANN001, ANN202
            s = (x.float() * scale).masked_fill(~mask[:, None, None, :], float("-inf"))
            return torch.softmax(s, dim=-1).to(x.dtype)  # NaN on the fully masked entry

        got = outputs_and_grads(ours, {"x": x})
        name = f"softmax {DTYPE_NAMES[dtype]} {B}x{H}x{S}"
        checks.close(f"{name} vs torch reference", got,
                     outputs_and_grads(reference, {"x": x}), dtype)
        want = outputs_and_grads(eager, {"x": x})
        checks.close(f"{name} vs eager torch.softmax", {k: v[:-1] for k, v in got.items()},
                     {k: v[:-1] for k, v in want.items()}, dtype)


class _SoftmaxReference(torch.autograd.Function):
    """The module's torch reference forward and backward, on the GPU."""

    @staticmethod
    def forward(ctx, x, mask, scale):  # noqa: ANN001, ANN205
        p = softmax_forward_torch(x, mask, scale)
        ctx.save_for_backward(p)
        ctx.scale = scale
        return p

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return softmax_backward_torch(ctx.saved_tensors[0], grad, ctx.scale), None, None


def check_loss(dtype: torch.dtype, n: int, v: int, n_valid: int, e: int, zero_frac: float,
               checks: Checks) -> None:
    gen = torch.Generator(DEVICE).manual_seed(n + v)
    inputs = {
        "h": (torch.randn(n, e, device=DEVICE, generator=gen) * 0.5).to(dtype),  # N x E
        "w": (torch.randn(v, e, device=DEVICE, generator=gen) * e**-0.5).to(dtype),  # V x E
        "b": (torch.randn(v, device=DEVICE, generator=gen) * 0.1).to(dtype),  # V
    }
    inputs = {k: t.requires_grad_() for k, t in inputs.items()}
    tgt = torch.randint(0, n_valid, (n,), device=DEVICE, generator=gen)  # N
    wts = (torch.rand(n, device=DEVICE, generator=gen) >= zero_frac).float()  # N, 0 or 1

    def op(h, w, b, backend=BACKEND, chunk=None, keep=0.0):  # noqa: ANN001, ANN202
        return linear_cross_entropy(h, w, b, tgt, wts, vocab_start=0, n_valid=n_valid,
                                    chunk_size=chunk, keep_logits_gib=keep, backend=backend)

    def eager(h, w, b):  # noqa: ANN001, ANN202
        logits = torch.addmm(b, h, w.t())[:, :n_valid].float()  # N x n_valid
        return F.cross_entropy(logits, tgt, reduction="none") * (wts != 0)

    name = f"loss {DTYPE_NAMES[dtype]} N={n} V={v} n_valid={n_valid} E={e}"
    got = outputs_and_grads(op, inputs)
    checks.close(f"{name} vs torch reference", got,
                 outputs_and_grads(lambda **i: op(**i, backend="torch"), inputs), dtype)
    want = outputs_and_grads(eager, inputs)
    checks.close(f"{name} vs F.cross_entropy", got, want, dtype)
    # 4 chunks, room for half the rows' logits: backward reads the first chunks' kept logits
    # (strided views) and recomputes the others
    half = n / 2 * v * dtype.itemsize / 2**30
    kept = outputs_and_grads(lambda **i: op(**i, chunk=-(-n // 4), keep=half), inputs)
    checks.close(f"{name} half the logits kept vs F.cross_entropy", kept, want, dtype)
    with torch.no_grad():
        same = torch.equal(op(**inputs)[1], op(**inputs, backend="torch")[1])
    checks.record(f"{name} correct flags equal the torch reference", same, "exact")
    if DEVICE == "cuda":
        torch.cuda.empty_cache()  # the fp32 full-logits oracle at N x V is the largest


# ---------------------------------------------------------------- speed
def fwd_bwd_ms(fn, inputs: list[torch.Tensor]) -> float:  # noqa: ANN001
    """Median ms of forward + backward of `fn(*inputs)` (a scalar-reducible output)."""
    import triton.testing

    def step() -> None:
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()

    try:
        return triton.testing.do_bench(step, warmup=5, rep=50)
    except Exception as exc:  # noqa: BLE001 - e.g. torch.compile unavailable, OOM
        print(f"    (skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:80]})")
        return float("nan")


def time_softmax(dtype: torch.dtype) -> None:
    print(f"\n== fused_scale_mask_softmax ({dtype}), fwd+bwd ms ==")
    print(f"{'B x H x S':<16} {'ours':>8} {'eager':>8} {'compile':>8} {'SDPA':>8}")
    for B, H, S in SOFTMAX_SHAPES:
        x = torch.randn(B, H, S, S, device="cuda", dtype=dtype, requires_grad=True)
        mask = torch.rand(B, S, device="cuda") > 0.1  # B x S
        scale = 64**-0.5

        def eager(x, mask=mask, scale=scale):  # noqa: ANN001, ANN202
            s = (x.float() * scale).masked_fill(~mask[:, None, None, :], float("-inf"))
            return torch.softmax(s, dim=-1).to(x.dtype)

        ours = lambda x, m=mask, s=scale: fused_scale_mask_softmax(x, m, s)  # noqa: E731
        q, k, v = (torch.randn(B, H, S, 64, device="cuda", dtype=dtype, requires_grad=True)
                   for _ in range(3))
        sdpa = lambda q, k, v, m=mask: F.scaled_dot_product_attention(  # noqa: E731
            q, k, v, attn_mask=m[:, None, None, :])
        t = [fwd_bwd_ms(f, i) for f, i in ((ours, [x]), (eager, [x]),
                                           (torch.compile(eager), [x]), (sdpa, [q, k, v]))]
        print(f"{f'{B}x{H}x{S}':<16} " + " ".join(f"{v:>8.3f}" for v in t))


def time_loss(dtype: torch.dtype, n: int, vocab: int, e: int, chunks: list[int],
              device: str = "cuda") -> None:
    print(f"\n== linear_cross_entropy ({dtype}) N={n} V={vocab} E={e}, fwd+bwd ms ==")
    h = (torch.randn(n, e, device=device) * 0.5).to(dtype).requires_grad_()  # N x E
    w = (torch.randn(vocab, e, device=device) * e**-0.5).to(dtype).requires_grad_()  # V x E
    b = torch.zeros(vocab, device=device, dtype=dtype, requires_grad=True)  # V
    tgt = torch.randint(0, vocab, (n,), device=device)  # N
    wts = torch.ones(n, device=device)  # N

    def ours(h, w, b, chunk=None):  # noqa: ANN001, ANN202
        return linear_cross_entropy(h, w, b, tgt, wts, vocab_start=0, n_valid=vocab,
                                    chunk_size=chunk)[0]

    def eager(h, w, b):  # noqa: ANN001, ANN202
        return F.cross_entropy(torch.addmm(b, h, w.t()).float(), tgt, reduction="none")

    runs = [(f"ours, {c} rows a chunk" if c else "ours", partial(ours, chunk=c or None))
            for c in chunks]
    for name, fn in (*runs, ("eager", eager), ("compile", torch.compile(eager))):
        ms, peak = ms_and_peak(fn, [h, w, b])
        print(f"  {name:<24} {ms:>9.2f} ms   extra peak {peak:6.2f} GiB")


def ms_and_peak(fn, inputs: list[torch.Tensor]) -> tuple[float, float]:  # noqa: ANN001
    """fwd_bwd_ms, and the peak memory above what was allocated before (GiB), the gradients
    of `inputs` included (cleared first: a previous run's would hide this run's)."""
    for t in inputs:
        t.grad = None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = fwd_bwd_ms(fn, inputs)
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def head_flops(n: int, h: int, e: int, v_local: int, rows: int, keep_gib: float,
               itemsize: int, cuda: bool) -> float:
    """Matmul FLOPs the head + fused loss execute, forward + backward: the dense layer 3x, the
    vocabulary projection 3x plus the recomputed rows' logits (kept rows skip them)."""
    recomputed = recomputed_rows(n, v_local, e, itemsize, keep_gib, rows or None, cuda)
    return 3 * 2 * n * h * e + 2 * e * v_local * (3 * n + recomputed)


def time_layer(config, micro: int, seq: int, dtype: torch.dtype, device: str) -> float:  # noqa: ANN001
    """fwd_bwd_ms of one Transformer layer of `config` on micro x seq tokens (no padding)."""
    layer = TransformerLayer(config).to(device, dtype)
    init_weights(layer, 0, config.initializer_range, "layer.")
    x = torch.randn(micro, seq, config.hidden_size, device=device, dtype=dtype,
                    requires_grad=True)  # micro x seq x H
    return fwd_bwd_ms(lambda x, *_: layer(x, None), [x, *layer.parameters()])


def time_head(dtype: torch.dtype, micro: int, predictions: int, chunks: list[int],
              keeps: list[float], preset: str = "rembert", seq: int = 512,
              device: str = "cuda") -> dict:
    """Prints each setting's time; returns the fastest of ours ({setting, ms, extra_gib}) and
    the layer's time, for bench/gpu_table.py. The decoder's gradients go into fp32 main
    gradients, as the trainer runs the head under bf16 + ZeRO-1 (parallel/grad_buffer.py)."""
    config = get_preset(preset)
    n, hid = micro * predictions, config.hidden_size
    print(f"\n== MLM head + loss ({dtype}), {preset}, {micro} x {predictions} = {n} masked "
          f"rows, fwd+bwd, against one Transformer layer at {micro} x {seq} ==")
    layer_ms = time_layer(config, micro, seq, dtype, device)
    print(f"  one Transformer layer          {layer_ms:>9.2f} ms")
    head = MLMHead(config).to(device, dtype)
    init_weights(head, 0, config.initializer_range, "mlm_head.")
    for param in (head.decoder.weight, head.decoder.bias):  # as the trainer's buffer sets up
        param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=device)
        param.main_grad_added = lambda: None
    inputs = [torch.randn(n, hid, device=device, dtype=dtype, requires_grad=True),
              *head.parameters()]  # N x H, then the head's parameters (fresh grads each step)
    labels = torch.randint(0, config.vocab_size, (n,), device=device)  # N
    weights = (torch.rand(n, device=device) >= 0.03).float()  # N, a few padding slots

    def ours(hidden, *_):  # noqa: ANN001, ANN202
        return head(hidden, labels, weights).loss_sum

    def full_logits(hidden, *_):  # noqa: ANN001, ANN202
        logits = F.linear(head.transform(hidden), head.decoder.weight, head.decoder.bias)
        losses = F.cross_entropy(logits[:, :config.vocab_size].float(), labels,
                                 reduction="none")  # N
        return (losses * weights).sum()

    v_local, e = head.decoder.weight.shape
    runs = [(f"rows {c or 'default'}, keep {k:g} GiB", c, k) for c in chunks for k in keeps]
    best = None
    for name, rows, keep in runs:
        head.loss_chunk_rows, head.loss_keep_logits_gib = rows or None, keep
        ms, peak = ms_and_peak(ours, inputs)
        flops = head_flops(n, hid, e, v_local, rows, keep, dtype.itemsize, device == "cuda")
        print(f"  {name:<30} {ms:>9.2f} ms   extra peak {peak:6.2f} GiB   "
              f"{flops / ms / 1e9:6.1f} TFLOP/s   head = {ms / layer_ms:.2f} layers")
        if best is None or ms < best["ms"]:
            best = {"setting": name, "ms": ms, "extra_gib": peak}
    for name, fn in (("eager full logits", full_logits),
                     ("compile full logits", torch.compile(full_logits))):
        ms, peak = ms_and_peak(fn, inputs)
        print(f"  {name:<30} {ms:>9.2f} ms   extra peak {peak:6.2f} GiB   "
              f"head = {ms / layer_ms:.2f} layers")
    return {"best": best, "layer_ms": layer_ms}


# ---------------------------------------------------------------- main
def parse_dtypes(text: str) -> list[torch.dtype]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in DTYPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {sorted(DTYPES)}, got {text!r}")
    return [DTYPES[s] for s in names]


def parse_chunks(text: str) -> list[int]:
    try:
        chunks = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        chunks = []
    if not chunks or min(chunks) < 0:
        raise argparse.ArgumentTypeError(
            f"expected rows per chunk (0: the default), comma-separated, got {text!r}")
    return chunks


def parse_gib(text: str) -> list[float]:
    try:
        values = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        values = []
    if not values or not all(0 <= v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(
            f"expected GiB of kept logits (0: recompute), comma-separated, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", type=parse_dtypes, default="fp32,bf16",
                   help="dtypes to check, comma-separated (default fp32,bf16)")
    p.add_argument("--time-dtype", choices=sorted(DTYPES), default="bf16",
                   help="dtype of the timing runs (default bf16, the training dtype)")
    p.add_argument("--no-timing", action="store_true", help="correctness checks only")
    p.add_argument("--rows", type=int, default=8192, help="masked tokens N for the loss")
    p.add_argument("--vocab", type=int, default=250_300)
    p.add_argument("--e", type=int, default=1664)
    p.add_argument("--loss-chunks", type=parse_chunks, default="0,512,1024,2048",
                   help="rows per chunk to time our loss at, comma-separated (0: the default "
                        "tiling; default 0,512,1024,2048)")
    p.add_argument("--micro", type=int, default=16,
                   help="head timing: sequences per micro-batch (default 16, configs/rembert)")
    p.add_argument("--predictions", type=int, default=77,
                   help="head timing: masked slots per sequence (default 77: 15%% of 512)")
    p.add_argument("--head-chunks", type=parse_chunks, default="0,128,256,512,1024,2048",
                   help="head timing: rows per chunk, comma-separated (0: the default)")
    p.add_argument("--head-keep", type=parse_gib, default="0,1",
                   help="head timing: GiB of kept logits, comma-separated (0: recompute; "
                        "default 0,1, 1 = model.loss_keep_logits_gib's default)")
    p.add_argument("--json", help="write the head timing's figures there (bench/gpu_table.py)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: bench.kernels_gpu needs a CUDA GPU (none found); "
                 "on CPU run the tests (pytest tests/kernels) and bench.loss_memory")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    checks = Checks()
    for dtype in args.dtype:
        check_softmax(dtype, checks)
        check_loss(dtype, args.rows, args.vocab, args.vocab, args.e, 0.0, checks)
        check_loss(dtype, 777, 4133, 4100, 256, 0.25, checks)  # padding, weight-0 rows
    if not args.no_timing:
        time_softmax(DTYPES[args.time_dtype])
        time_loss(DTYPES[args.time_dtype], args.rows, args.vocab, args.e, args.loss_chunks)
        head = time_head(DTYPES[args.time_dtype], args.micro, args.predictions,
                         args.head_chunks, args.head_keep)
        if args.json:  # bench/gpu_table.py
            write_json(args.json, head)
    print(f"\n{checks.total - len(checks.failed)} of {checks.total} checks passed")
    if checks.failed:
        sys.exit("FAILED: " + "; ".join(checks.failed))


if __name__ == "__main__":
    main()
