"""Peak memory and time of the MLM loss path, forward + backward, on CPU.

    python -m bench.loss_memory --n 8192 --dtype bf16 --runs 5  # minutes with AMX/AVX512-BF16
    python -m bench.loss_memory --n 256 --dtype bf16 --no-mkldnn   # the no-AVX512 route
    python -m bench.loss_memory --n 1024 --v 65536 --dtype fp32 --runs 3

Variants, each in its own fresh subprocess so that one cannot inherit the other's peak:
  ours   linear_cross_entropy (chunked; torch path on CPU), all N rows with weight 1
  naive  logits = hidden @ W.T + b (N x V in the input dtype), F.cross_entropy, backward

What is measured: in the child, after the inputs (hidden N x E, W V x E, b V, targets) are
allocated and touched, the current resident set size (VmRSS) is the baseline; after one
forward + backward the child's peak resident set size (VmHWM) minus that baseline is the
"extra peak": every byte the loss path held at its worst moment, including the gradients it
returns (grad_weight alone is V x E in the input dtype, for both variants). Time is one cold
forward + backward (no warm-up), wall clock. Linux only (VmRSS from /proc).

Each variant runs --runs times (fresh processes); the median and the spread (min..max) are
printed. The children run with a fixed MALLOC_MMAP_THRESHOLD_ (1 MiB): every large buffer is
mapped and returned on free, so the peak RSS is what was alive at once, not what glibc's
per-thread arenas kept (--glibc-default keeps glibc's dynamic threshold).

Next to the measurement, `ours_bound` adds up, by construction of the chunked path
(kernels/cross_entropy.py), every buffer alive at its worst moment, on either CPU GEMM route
for bf16: oneDNN's (CPUs with AVX512) or torch's fallback (without AVX512, or --no-mkldnn),
which accumulates each bf16 product in an fp32 buffer of the product's full shape. The
fallback is what made one bf16 run of the earlier loss measure 2.46 GiB instead of 1.02: its
backward added every chunk's product into a V x E bf16 grad_weight (`addmm_`), so each call
held a V x E fp32 buffer (1.55 GiB); the tiled backward's products are at most 2^25 elements.
The naive path needs 3 N x V logits-sized tensors plus grad_weight on any route. The ratio of
the two is the memory advantage at any N, V, E and dtype without running it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.memwatch import mem_available, status_bytes

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
DTYPES = {"fp32": 4, "bf16": 2}
# The smallest run (seconds; two child processes): tests/bench/test_every_bench.py.
TINY_ARGS = ["--n", "64", "--v", "1000", "--e", "32", "--dtype", "fp32", "--runs", "1"]


def reset_peak() -> None:
    """Start VmHWM again from the current RSS (Linux >= 4.0); where refused, VmHWM keeps the
    process's peak so far, which only the imports and the inputs have set."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def naive_estimate(n: int, v: int, e: int, itemsize: int) -> int:
    """Bytes the naive path needs at its worst: logits, log-probs and their gradient (3 N x V)
    plus grad_weight; used only to refuse a run that would push the machine into OOM."""
    return 3 * n * v * itemsize + v * e * itemsize


def ours_bound(n: int, v: int, e: int, itemsize: int,
               chunk_elements: int | None = None, keep_gib: float = 0.0) -> dict[str, int]:
    """Bytes the chunked loss holds at its worst moment, term by term (torch path on CPU; the
    Triton kernels on CUDA need no fp32 copies of a tile, so this bounds them too).

    In a reduced precision (bf16) two routes exist on CPU: oneDNN's GEMM (CPUs with AVX512)
    writes the product directly; torch's fallback GEMM (no AVX512, or --no-mkldnn) first
    accumulates the whole product in an fp32 buffer of the output's shape. Each phase below
    counts that buffer, so the bound holds on both routes. Logits kept for backward
    (`keep_gib`) stay from the forward to the end of the backward.
    """
    from megatron_rembert.kernels.cross_entropy_tiling import choose_tiling, kept_rows, row_chunks

    t = choose_tiling(v, e, None, chunk_elements)
    rows_f, rows_b, block = min(t.forward_rows, n), min(t.backward_rows, n), min(t.vocab_block, v)
    keep = kept_rows(row_chunks(0, n, t.forward_rows), v, itemsize, keep_gib)
    backward_chunks = row_chunks(0, keep, t.backward_rows) + row_chunks(keep, n, t.backward_rows)
    reduced = itemsize != 4
    f32 = 4 if reduced else 0  # fp32 copy of a bf16 tile, or the fallback GEMM's buffer
    persistent = {
        "grad_weight V x E": v * e * itemsize,
        "grad_bias (fp32 + cast)": v * (4 + itemsize),
        "grad_hidden fp32 accumulator N x E": n * e * 4,
        "grad_hidden N x E (returned; hidden itself is saved, not copied)": n * e * itemsize,
        "per-row vectors": n * 48,  # ids, targets, lse, sums, losses, upstream gradient
        "kept logits": keep * v * itemsize,
    }
    # forward, per row chunk: the GEMM (logits + fallback buffer), then the softmax
    # statistics (logits + fp32 copy + exp temporary), the larger of the two
    forward = {"forward logits chunk (+fp32 copy, exp temporary)":
               rows_f * v * (itemsize + f32 + 4)}
    # backward, per tile, beside the tile itself and the block's grad_weight sum: the softmax
    # (fp32 copy of the tile), or the grad_hidden GEMM (product + fallback buffer), or the
    # grad_weight GEMM (product + fallback buffer); one at a time. In fp32 the GEMMs add into
    # the gradients in place, and so does a bf16 block covered by one row chunk: no sum buffer.
    one_product = not reduced or len(backward_chunks) <= 1
    step = max(rows_b * block * f32, reduced * rows_b * e * (itemsize + f32),
               reduced * block * e * (itemsize + f32))
    backward = {
        "block grad_weight fp32 sum": 0 if one_product else block * e * 4,
        "backward tile": rows_b * block * itemsize,
        "worst step (tile's fp32 copy or a GEMM product + buffer)": step,
    }
    worst = forward if sum(forward.values()) > sum(backward.values()) else backward
    return {**persistent, **worst}


def gemm_route(no_mkldnn: bool) -> str:
    """Which CPU GEMM a bf16 matmul takes in this process (see ours_bound)."""
    import torch

    cap = torch.backends.cpu.get_cpu_capability()
    if not no_mkldnn and torch.backends.mkldnn.is_available() and cap.startswith("AVX512"):
        return f"oneDNN (CPU capability {cap})"
    return f"torch's fallback, fp32 buffer per product (CPU capability {cap}" + (
        ", oneDNN disabled by --no-mkldnn)" if no_mkldnn else ")")


def child(variant: str, n: int, v: int, e: int, dtype_name: str, threads: int,
          no_mkldnn: bool, chunk_elements: int | None, keep_gib: float) -> None:
    import torch
    import torch.nn.functional as F

    from megatron_rembert.kernels import cross_entropy_tiling
    from megatron_rembert.kernels.cross_entropy import linear_cross_entropy

    if chunk_elements:
        cross_entropy_tiling.CHUNK_ELEMENTS = chunk_elements
    torch.set_num_threads(threads)
    torch.backends.mkldnn.enabled = not no_mkldnn
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    torch.manual_seed(0)
    # in-place init: no temporary larger than the tensor itself inflates the baseline
    hidden = torch.empty(n, e, dtype=dtype).normal_().requires_grad_()  # N x E
    weight = torch.empty(v, e, dtype=dtype).normal_(std=e**-0.5).requires_grad_()  # V x E
    bias = torch.zeros(v, dtype=dtype).requires_grad_()  # V
    targets = torch.randint(0, v, (n,))  # N
    weights = torch.ones(n)  # N
    reset_peak()
    baseline = status_bytes("VmRSS")

    start = time.perf_counter()
    if variant == "ours":
        losses, _ = linear_cross_entropy(
            hidden, weight, bias, targets, weights, vocab_start=0, n_valid=v, backend="torch",
            keep_logits_gib=keep_gib,
        )
        loss = (losses * weights).sum() / weights.sum()
    else:
        loss = F.cross_entropy(torch.addmm(bias, hidden, weight.t()), targets)
    loss.backward()
    seconds = time.perf_counter() - start
    # not getrusage's ru_maxrss: Linux carries it over from the parent through fork + exec, so
    # a child of a large process (a test runner) would report the parent's size
    peak = status_bytes("VmHWM")
    print(json.dumps(dict(extra=peak - baseline, baseline=baseline, seconds=seconds,
                          loss=loss.item())))


def run_variant(variant: str, n: int, v: int, e: int, dtype: str, threads: int = 2,
                no_mkldnn: bool = False, glibc_default: bool = False,
                chunk_elements: int | None = None, keep_gib: float = 0.0) -> dict:
    """One fresh child: {extra, baseline, seconds, loss} in bytes / s, or {error}."""
    cmd = [sys.executable, "-m", "bench.loss_memory", "--child", variant, "--n", str(n),
           "--v", str(v), "--e", str(e), "--dtype", dtype, "--threads", str(threads)]
    cmd += ["--no-mkldnn"] if no_mkldnn else []
    cmd += ["--chunk-elements", str(chunk_elements)] if chunk_elements else []
    cmd += ["--keep-gib", str(keep_gib)] if keep_gib else []
    env = dict(os.environ)
    if not glibc_default:
        env["MALLOC_MMAP_THRESHOLD_"] = str(2**20)  # fixed: large buffers go back on free
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode < 0:
        return dict(error=f"killed by signal {-proc.returncode} (likely out of memory)")
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        return dict(error=f"failed: {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=8192, help="masked tokens (rows)")
    p.add_argument("--v", type=int, default=250_300, help="vocabulary size")
    p.add_argument("--e", type=int, default=1664, help="output embedding size E_out")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=3, help="fresh processes per variant")
    p.add_argument("--glibc-default", action="store_true",
                   help="keep glibc's dynamic mmap threshold in the children (see above)")
    p.add_argument("--no-mkldnn", action="store_true",
                   help="children run with oneDNN disabled: bf16 GEMMs take torch's fallback, "
                        "the route on CPUs without AVX512 (slow: ~4 GFLOP/s)")
    p.add_argument("--chunk-elements", type=int, default=None,
                   help="tile budget of the chunked loss in elements (default: the library's "
                        "CHUNK_ELEMENTS, 2^25)")
    p.add_argument("--keep-gib", type=float, default=0.0,
                   help="GiB of forward logits ours keeps for backward instead of recomputing "
                        "them (linear_cross_entropy's keep_logits_gib; default 0)")
    p.add_argument("--child", choices=["ours", "naive"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.n, args.v, args.e, args.dtype, args.threads, args.no_mkldnn,
              args.chunk_elements, args.keep_gib)
        return

    item = DTYPES[args.dtype]
    print(f"MLM loss fwd+bwd on CPU: N={args.n} V={args.v} E={args.e} dtype={args.dtype} "
          f"threads={args.threads}")
    if args.dtype != "fp32":
        print(f"{args.dtype} GEMM route: {gemm_route(args.no_mkldnn)}")
    print(f"one N x V logits tensor = {args.n * args.v * item / GIB:.2f} GiB; "
          f"grad_weight (V x E, part of both) = {args.v * args.e * item / GIB:.2f} GiB")
    print("extra peak = child's peak RSS (VmHWM) - its RSS after allocating the inputs")
    bound = ours_bound(args.n, args.v, args.e, item, args.chunk_elements, args.keep_gib)
    naive_need = naive_estimate(args.n, args.v, args.e, item)
    print(f"ours by construction: {sum(bound.values()) / GIB:.3f} GiB at most (" + ", ".join(
        f"{k} {b / GIB:.3f}" for k, b in bound.items()) + ")")
    print(f"naive by construction: {naive_need / GIB:.3f} GiB (3 N x V + grad_weight); "
          f"ratio {naive_need / sum(bound.values()):.1f}x")
    results = {}
    for variant in ("ours", "naive"):
        need = naive_need if variant == "naive" else 0
        if need > 0.85 * mem_available():
            results[variant] = [dict(error=f"skipped: needs ~{need / GIB:.1f} GiB, "
                                           f"{mem_available() / GIB:.1f} GiB available")]
            continue
        results[variant] = [
            run_variant(variant, args.n, args.v, args.e, args.dtype, args.threads,
                        args.no_mkldnn, args.glibc_default, args.chunk_elements, args.keep_gib)
            for _ in range(args.runs)]
    print(f"\n{'variant':<8} {'extra peak GiB: median':>22} {'min':>7} {'max':>7} "
          f"{'time s':>8} {'loss':>10}")
    medians = {}
    for variant, runs in results.items():
        bad = [r for r in runs if "error" in r]
        if bad:
            print(f"{variant:<8} {bad[0]['error']}")
            continue
        extra = [r["extra"] / GIB for r in runs]
        medians[variant] = statistics.median(extra)
        print(f"{variant:<8} {medians[variant]:>22.3f} {min(extra):>7.3f} {max(extra):>7.3f} "
              f"{statistics.median(r['seconds'] for r in runs):>8.2f} {runs[0]['loss']:>10.5f}")
    if len(medians) == 2:
        print(f"\nloss difference ours - naive: "
              f"{results['ours'][0]['loss'] - results['naive'][0]['loss']:+.2e}")
        if args.dtype == "bf16":
            print("(naive F.cross_entropy on bf16 logits returns bf16 log-probs and loss, ulp "
                  "0.0625 near 13; ours does the softmax math in fp32)")
        print(f"ours measured / bound: {medians['ours'] * GIB / sum(bound.values()):.2f}")
        print(f"peak memory ratio naive / ours (medians): "
              f"{medians['naive'] / medians['ours']:.1f}x")
    else:
        print("\npeak memory ratio: n/a (a variant did not run)")


if __name__ == "__main__":
    main()
