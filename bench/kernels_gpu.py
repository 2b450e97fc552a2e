"""Correctness and speed of the Triton kernels on a CUDA GPU (needs only torch + triton).

    python bench/kernels_gpu.py [--dtype bf16] [--rows 8192] [--vocab 250300]

For each op: the max error of the Triton path against the torch reference on the GPU, then
forward + backward time (triton.testing.do_bench, median ms) of
  softmax: ours (Triton) | torch eager | torch.compile | SDPA (whole attention, for scale)
  loss:    ours (Triton, chunked) | torch eager full logits | torch.compile full logits
Exits with a message when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from megatron_rembert.kernels.cross_entropy import linear_cross_entropy  # noqa: E402
from megatron_rembert.kernels.softmax import fused_scale_mask_softmax  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def grads(fn, inputs: list[torch.Tensor], grad_seed: int = 0) -> list[torch.Tensor]:  # noqa: ANN001
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.randn(out.shape, generator=torch.Generator(out.device).manual_seed(grad_seed),
                    device=out.device)
    (out.float() * g).sum().backward()
    return [out.detach().float()] + [t.grad.float() for t in inputs]


def max_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    return " ".join(f"{(x - y).abs().max().item():.1e}" for x, y in zip(a, b, strict=True))


def bench_softmax(dtype: torch.dtype, rows: dict) -> None:
    print(f"\n== fused_scale_mask_softmax ({dtype}), fwd+bwd ms ==")
    print(f"{'B x H x S':<16} {'err p dx':>18} {'ours':>8} {'eager':>8} {'compile':>8} "
          f"{'SDPA':>8}")
    for B, H, S in rows:
        x = torch.randn(B, H, S, S, device="cuda", dtype=dtype, requires_grad=True)
        mask = torch.rand(B, S, device="cuda") > 0.1  # B x S
        scale = 64**-0.5

        def eager(x, mask=mask, scale=scale):  # noqa: ANN001, ANN202
            s = (x.float() * scale).masked_fill(~mask[:, None, None, :], float("-inf"))
            return torch.softmax(s, dim=-1).to(x.dtype)

        ours = lambda x, m=mask, s=scale: fused_scale_mask_softmax(x, m, s)  # noqa: E731
        err = max_err(grads(ours, [x]), grads(eager, [x]))
        compiled = torch.compile(eager)
        q, k, v = (torch.randn(B, H, S, 64, device="cuda", dtype=dtype, requires_grad=True)
                   for _ in range(3))
        sdpa = lambda q, k, v, m=mask: F.scaled_dot_product_attention(  # noqa: E731
            q, k, v, attn_mask=m[:, None, None, :])
        t = [fwd_bwd_ms(f, i) for f, i in ((ours, [x]), (eager, [x]), (compiled, [x]),
                                           (sdpa, [q, k, v]))]
        print(f"{f'{B}x{H}x{S}':<16} {err:>18} " + " ".join(f"{v:>8.3f}" for v in t))


def bench_loss(dtype: torch.dtype, n: int, vocab: int, e: int) -> None:
    print(f"\n== linear_cross_entropy ({dtype}) N={n} V={vocab} E={e}, fwd+bwd ms ==")
    h = (torch.randn(n, e, device="cuda") * 0.5).to(dtype).requires_grad_()  # N x E
    w = (torch.randn(vocab, e, device="cuda") * e**-0.5).to(dtype).requires_grad_()  # V x E
    b = torch.zeros(vocab, device="cuda", dtype=dtype, requires_grad=True)  # V
    tgt = torch.randint(0, vocab, (n,), device="cuda")  # N
    wts = torch.ones(n, device="cuda")  # N

    def ours(h, w, b):  # noqa: ANN001, ANN202
        return linear_cross_entropy(h, w, b, tgt, wts, vocab_start=0, n_valid=vocab)[0]

    def torch_ref(h, w, b):  # noqa: ANN001, ANN202
        return linear_cross_entropy(h, w, b, tgt, wts, vocab_start=0, n_valid=vocab,
                                    backend="torch")[0]

    def eager(h, w, b):  # noqa: ANN001, ANN202
        return F.cross_entropy(torch.addmm(b, h, w.t()).float(), tgt, reduction="none")

    print("max err vs torch reference (loss dh dw db):",
          max_err(grads(ours, [h, w, b]), grads(torch_ref, [h, w, b])))
    print("max err vs eager full logits (loss dh dw db):",
          max_err(grads(ours, [h, w, b]), grads(eager, [h, w, b])))
    for name, fn in (("ours", ours), ("eager", eager), ("compile", torch.compile(eager))):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = fwd_bwd_ms(fn, [h, w, b])
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(f"  {name:<8} {ms:>9.2f} ms   extra peak {peak:6.2f} GiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--rows", type=int, default=8192, help="masked tokens N for the loss")
    p.add_argument("--vocab", type=int, default=250_300)
    p.add_argument("--e", type=int, default=1664)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels_gpu.py needs a CUDA GPU (none found); "
                 "on CPU run the tests (pytest tests/kernels) and bench/loss_memory.py")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    dtype = DTYPES[args.dtype]
    bench_softmax(dtype, [(8, 16, 128), (8, 16, 512), (2, 16, 1000), (1, 16, 4096)])
    bench_loss(dtype, args.rows, args.vocab, args.e)


if __name__ == "__main__":
    main()
