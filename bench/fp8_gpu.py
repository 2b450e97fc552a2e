"""train.fp8 on a GPU: the Transformer layers' linears in fp8 against bf16, side by side.

1. The fp8 GEMMs on CUDA (cuBLASLt's `_scaled_mm`, which takes only the operand layouts
   parallel/fp8.py builds) against plain-torch quantisation, forward and both gradients, at
   rembert's shapes (1152 -> 1152 and 1152 -> 4608): the CPU tests cannot show that CUDA
   accepts them.
2. Speed: the `rembert` preset's model step (16 x 512 tokens, bf16 weights, torch's fused
   AdamW, attention on the flash path; as bench/train_throughput.py's preset_throughput) with
   fp8 off and on: tokens/s, model TFLOP/s, MFU against the GPU's bf16 peak (the model's FLOPs
   do not change; fp8 tensor cores peak at twice bf16's) and the ratio fp8 / bf16.
3. Convergence: configs/demo.yaml's model trained 300 steps in bf16 and in fp8 on the same
   synthetic batches made here (rows whose tokens only their context predicts: a block of a
   row-specific topic's tokens, repeated), both loss curves, the final losses and their
   ratio, which must be within --loss-tolerance.

Needs torch and triton only (no DeepSpeed); a GPU of compute capability >= 8.9 (Ada, Hopper).
Exit status 1 when a check fails.

    python -m bench.fp8_gpu [--steps 5] [--curve-steps 300] [--compile]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from bench.common import make_batch, relative_error, timed, write_json
from megatron_rembert.config import ModelConfig, get_preset
from megatron_rembert.model.rembert import RemBertForPreTraining
from megatron_rembert.model.sizes import flops_per_token
from megatron_rembert.model.transformer import TransformerLayer
from megatron_rembert.parallel.fp8 import enable_fp8, follow_optimizer
from megatron_rembert.parallel.layers import ColumnParallelLinear, RowParallelLinear

# configs/demo.yaml's model (PyYAML is not needed here; a test keeps the two equal).
DEMO_MODEL = get_preset("tiny").replace(vocab_size=1000, hidden_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, intermediate_size=512,
                                        input_embedding_size=64, output_embedding_size=128)
DEMO_BATCH, DEMO_SEQ, DEMO_LR, DEMO_WARMUP = 64, 64, 1e-3, 50  # demo.yaml's data and optim
BLOCK = 16  # synthetic rows: a block of this many tokens, repeated
TOPIC_SIZE = 50  # ... drawn from one topic of this many token ids
LEARNT = 0.8  # the bf16 demo run must end below this fraction of its first loss
# The GEMM checks' tolerance on max|ours - reference| / max|reference|: the outputs are bf16.
GEMM_TOLERANCE = 2e-2
# Without CUDA (or fp8 tensor cores) it refuses with one line; its GEMM check also runs as a
# test (pytest -m gpu). The smallest run: tests/bench/test_every_bench.py.
NEEDS_CUDA = True
TINY_ARGS = ["--steps", "1", "--batch", "2", "--seq", "64"]  # the demo curves in full


def build(config: ModelConfig, device, fp8: bool, lr: float, **adamw
          ) -> tuple[RemBertForPreTraining, torch.optim.AdamW]:
    """The model in bf16 (its Transformer linears in fp8 if asked) and its AdamW (fused on
    CUDA), whose steps renew the fp8 weight copies (fused AdamW moves no `_version`)."""
    torch.manual_seed(0)
    model = RemBertForPreTraining(config).to(device)
    model.init_weights(0)
    model = model.to(torch.bfloat16)
    gemms = (enable_fp8(m for m in model.modules() if isinstance(m, TransformerLayer))
             if fp8 else [])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr,
                                  fused=torch.device(device).type == "cuda", **adamw)
    if gemms:
        follow_optimizer(gemms, optimizer)
    return model, optimizer


# -- 1. the GEMMs on CUDA against plain-torch quantisation ---------------------------------
def dequantized(t: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    fp8_max = torch.finfo(fp8_dtype).max
    scale = 2.0 ** math.floor(math.log2(fp8_max / t.detach().abs().max().item()))
    return (t.detach().float() * scale).to(fp8_dtype).float() / scale


def check_gemms(device, tokens: int = 2048, hidden: int = 1152, ffn: int = 4608) -> list[str]:
    """Column- and row-parallel linears at rembert's shapes in fp8: y, dx and dW against
    x, W (e4m3) and dy (e5m2) quantised by plain torch and multiplied in fp32. Returns the
    failures."""
    failures = []
    g = torch.Generator().manual_seed(0)
    for kind, k, n in ((ColumnParallelLinear, hidden, hidden), (ColumnParallelLinear, hidden, ffn),
                       (RowParallelLinear, ffn, hidden)):
        layer = kind(k, n)
        with torch.no_grad():
            layer.weight.copy_(0.02 * torch.randn(n, k, generator=g))
            layer.bias.zero_()
        layer = layer.to(device, torch.bfloat16)
        enable_fp8([layer])
        x = torch.randn(tokens, k, generator=g).to(device, torch.bfloat16).requires_grad_()
        dy = (1e-4 * torch.randn(tokens, n, generator=g)).to(device, torch.bfloat16)
        y = layer(x)
        y.backward(dy)
        xq, wq = dequantized(x, torch.float8_e4m3fn), dequantized(layer.weight, torch.float8_e4m3fn)
        gq = dequantized(dy, torch.float8_e5m2)
        for what, ours, ref in (("y", y, xq @ wq.t()), ("dx", x.grad, gq @ wq),
                                ("dW", layer.weight.grad, gq.t() @ xq)):
            err = relative_error(ours, ref)
            name = f"{kind.__name__} {k} -> {n} {what}"
            print(f"  {name}: error {err:.2e}" + ("" if err <= GEMM_TOLERANCE else "  FAILED"))
            if err > GEMM_TOLERANCE:
                failures.append(name)
    return failures


# -- 2. speed --------------------------------------------------------------------------------
def model_step(config: ModelConfig, batch: int, seq: int, steps: int, device, fp8: bool,
               sync) -> dict:
    """The model's training step in bf16 with torch's fused AdamW: tokens/s and TFLOP/s."""
    model, optimizer = build(config, device, fp8, lr=1e-4)
    batches = [make_batch(config, batch, seq, s, device) for s in range(steps + 1)]

    def step(b):
        optimizer.zero_grad(set_to_none=True)
        out = model(**b)
        (out.loss_sum / out.num_tokens).backward()
        optimizer.step()

    tokens_per_s = batch * seq / timed(step, batches, sync)
    return {"tokens_per_s": tokens_per_s,
            "tflops": flops_per_token(config, seq)["training"] * tokens_per_s / 1e12}


# -- 3. convergence --------------------------------------------------------------------------
def synthetic_batch(config: ModelConfig, batch: int, seq: int, step: int, device) -> dict:
    """Rows that only context predicts: each row draws a BLOCK of tokens from its own topic
    (TOPIC_SIZE consecutive ids, uniform) and repeats it; 15% of the positions masked ([MASK]
    = 4 in the input, the original as label). Without context a token costs
    ln(topics x TOPIC_SIZE) nats (~6.9 for the demo's 1000), with the row's topic
    ln(TOPIC_SIZE) = 3.9, with its copies less. The same batch for a given step."""
    g = torch.Generator().manual_seed(10_000 + step)
    topics = (config.vocab_size - 5) // TOPIC_SIZE
    topic = torch.randint(0, topics, (batch, 1), generator=g)
    blocks = 5 + topic * TOPIC_SIZE + torch.randint(0, TOPIC_SIZE, (batch, BLOCK), generator=g)
    ids = blocks.repeat(1, -(-seq // BLOCK))[:, :seq]
    p = max(1, round(0.15 * seq))
    positions = torch.stack([torch.randperm(seq, generator=g)[:p] for _ in range(batch)])
    labels = ids.gather(1, positions)
    out = dict(input_ids=ids.scatter(1, positions, 4), attention_mask=torch.ones_like(ids),
               token_type_ids=torch.zeros_like(ids), masked_positions=positions,
               masked_labels=labels, masked_weights=torch.ones(batch, p),
               unpadded=torch.ones(1, dtype=torch.long))
    return {k: v if k == "unpadded" else v.to(device) for k, v in out.items()}


def loss_curve(config: ModelConfig, steps: int, batch: int, seq: int, device, fp8: bool,
               lr: float = DEMO_LR, warmup: int = DEMO_WARMUP) -> list[float]:
    """`steps` AdamW steps (linear warm-up, then constant) on the synthetic batches."""
    model, optimizer = build(config, device, fp8, lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup)))
    losses = []
    for step in range(steps):
        out = model(**synthetic_batch(config, batch, seq, step, device))
        loss = out.loss_sum / out.num_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def compare_curves(bf16: list[float], fp8: list[float], tolerance: float) -> list[str]:
    """Prints the curves every ~10% of the steps and the final losses; returns failures."""
    every = max(1, len(bf16) // 10)
    for i in sorted({*range(0, len(bf16), every), len(bf16) - 1}):
        print(f"  step {i + 1:4d}: bf16 {bf16[i]:.4f}  fp8 {fp8[i]:.4f}")
    ratio = fp8[-1] / bf16[-1]
    ok = abs(ratio - 1.0) <= tolerance
    print(f"  final loss: bf16 {bf16[-1]:.4f}, fp8 {fp8[-1]:.4f}, fp8 / bf16 {ratio:.4f}"
          + ("" if ok else f"  FAILED (tolerance {tolerance:.0%})"))
    return [] if ok else ["loss curve"]


def step_figures(results: dict, peak: float | None) -> dict:
    """fp8 against bf16 from model_step's results {fp8: figures}."""
    return {"fp8_over_bf16": results[True]["tokens_per_s"] / results[False]["tokens_per_s"],
            "fp8_tokens_per_s": results[True]["tokens_per_s"],
            "fp8_mfu": results[True]["tflops"] * 1e12 / peak if peak else None}


def table_figures(results: dict, peak: float | None, curves: list[list[float]]) -> dict:
    """What bench/gpu_table.py reads: the step's figures and the demo losses' final ratio."""
    bf16, fp8 = curves
    return {**step_figures(results, peak), "loss_ratio": fp8[-1] / bf16[-1]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--curve-steps", type=int, default=300)
    parser.add_argument("--loss-tolerance", type=float, default=0.05,
                        help="largest |fp8 / bf16 - 1| of the final demo losses")
    parser.add_argument("--compile", action="store_true",
                        help="the rembert step with model.compile as well")
    parser.add_argument("--json", help="write the figures there (bench/gpu_table.py)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: bench.fp8_gpu needs a CUDA GPU of compute capability >= 8.9 (none "
                 "found); the CPU tests run the fp8 path (tests/parallel/test_fp8.py)")
    if torch.cuda.get_device_capability() < (8, 9):
        sys.exit(f"error: bench.fp8_gpu: {torch.cuda.get_device_name()} has no fp8 tensor "
                 "cores (compute capability < 8.9)")
    from megatron_rembert.training.metrics import peak_flops

    device = torch.device("cuda")
    name = torch.cuda.get_device_name()
    print(f"{name}: fp8 GEMMs against plain-torch quantisation")
    failed = check_gemms(device)
    peak = peak_flops(device)
    first = None  # the eager configuration's results
    for compile in (False, True) if args.compile else (False,):
        config = get_preset("rembert").replace(compile=compile)
        results = {}
        for fp8 in (False, True):
            r = model_step(config, args.batch, args.seq, args.steps, device, fp8,
                           torch.cuda.synchronize)
            results[fp8] = r
            mfu = f"{r['tflops'] * 1e12 / peak:.1%}" if peak else "n/a"
            print(f"rembert model step{' (model.compile)' if compile else ''}, {args.batch} x "
                  f"{args.seq} tokens, {'fp8' if fp8 else 'bf16'}: {r['tokens_per_s']:,.0f} "
                  f"tokens/s, {r['tflops']:.1f} TFLOP/s, MFU {mfu} (of the bf16 peak)")
            torch.cuda.empty_cache()
        first = first or results
        print(f"  fp8 / bf16: {step_figures(results, peak)['fp8_over_bf16']:.3f}")
    print(f"demo model, {args.curve_steps} steps of {DEMO_BATCH} x {DEMO_SEQ} synthetic tokens:")
    curves = [loss_curve(DEMO_MODEL, args.curve_steps, DEMO_BATCH, DEMO_SEQ, device, fp8)
              for fp8 in (False, True)]
    failed += compare_curves(*curves, args.loss_tolerance)
    if args.json:  # bench/gpu_table.py: the eager step (the first one timed)
        write_json(args.json, table_figures(first, peak, curves))
    if not curves[0][-1] < LEARNT * curves[0][0]:  # else the comparison would say nothing
        print(f"  FAILED: bf16 did not learn (final loss not below {LEARNT} x the first)")
        failed.append("demo model learning")
    if failed:
        sys.exit("FAILED: " + "; ".join(failed))


if __name__ == "__main__":
    main()
