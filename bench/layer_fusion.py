"""One Transformer layer, forward + backward: eager against model.compile, side by side.

    python -m bench.layer_fusion [--preset rembert] [--batch 16] [--seq 512] [--dtype bf16]
                                 [--layers 4] [--iters 10] [--masked] [--dropout 0,0.1]
                                 [--attention-backend sdpa,fused_softmax] [--cpu]

For every attention backend and dropout rate given (on a GPU by default sdpa and fused_softmax,
each at dropout 0 and 0.1; on CPU sdpa at 0):
rows, each the median of 5 rounds of --iters steps (the rows take turns within a round) of a
stack of --layers layers, per layer:
  eager     TransformerLayer with model.compile=false
  compiled  the same layers with model.compile=true (one graph, shared by the layers)
  matmuls   the layer's six Linear GEMMs (Q, K, V, attention output, FFN in, FFN out: forward
            and both backward GEMMs each) and attention (SDPA forward + backward) alone, each
            on its own input so nothing else runs: what the layer costs with every
            elementwise pass (bias, GELU, dropout, residual, LayerNorm, copies) fused away
Printed: ms per layer, TFLOP/s (the layer's training FLOPs, model/sizes.py), compiled / eager
speed-up, and the share of the eager and compiled layers' time outside the matmuls.
Defaults: on a GPU the rembert layer as trained (bf16, micro-batch 16 x 512, 4 layers); on
CPU (inductor's C++ backend) fp32, 2 x 128, 1 layer, 3 steps a round (a CPU figure says the
compiled path runs and equals eager, not what a GPU gains). Both paths are first checked to
agree (fp32: 1e-4 relative, bf16: 5e-2; with dropout they draw the same masks), and the
compiled layers' graphs, graph breaks and compile time (the first step) are printed; the
exit status is 1 if they differ or a graph broke.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from bench.common import device_sync, write_json
from megatron_rembert.config import ModelConfig, get_preset
from megatron_rembert.model.sizes import flops_per_token
from megatron_rembert.model.transformer import TransformerLayer
from megatron_rembert.parallel import random as tp_random
from megatron_rembert.parallel.layers import init_weights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROUNDS = 5
# The smallest run (seconds, CPU; compiling the layer is most of it): test_every_bench.py.
TINY_ARGS = ["--preset", "tiny", "--batch", "2", "--seq", "16", "--layers", "2", "--iters", "1",
             "--masked", "--dropout", "0.1", "--cpu", "--json", "{tmp}/layer.json"]


def layer_training_flops(config: ModelConfig, seq: int) -> float:
    """Matmul FLOPs of one layer's forward + backward per token."""
    per_token = (flops_per_token(config.replace(num_hidden_layers=2), seq)["training"]
                 - flops_per_token(config.replace(num_hidden_layers=1), seq)["training"])
    return per_token


def seconds_per_step(steps: dict, iters: int, sync) -> dict[str, float]:
    """Seconds per step of each variant: one warm-up step each (it compiles), then ROUNDS
    rounds of `iters` steps, the variants taking turns within a round (so that load from
    other processes falls on all of them alike); the median round of each."""
    for step in steps.values():
        step()
    sync()
    rounds: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(ROUNDS):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(iters):
                step()
            sync()
            rounds[name].append((time.perf_counter() - start) / iters)
    return {name: statistics.median(times) for name, times in rounds.items()}


def layer_stack(config: ModelConfig, layers: int, device, dtype) -> torch.nn.ModuleList:
    stack = torch.nn.ModuleList(TransformerLayer(config) for _ in range(layers))
    init_weights(stack, 0, config.initializer_range)
    return stack.to(device=device, dtype=dtype)


def layer_step(stack, x: torch.Tensor, key_mask, grad: torch.Tensor):
    """Forward and backward through the stack, as in training (fresh gradients each step)."""
    def step() -> torch.Tensor:
        stack.zero_grad(set_to_none=True)
        inp = x.detach().requires_grad_()
        out = inp
        for layer in stack:
            out = layer(out, key_mask)
        out.backward(grad)
        return out.detach()
    return step


def matmuls_step(config: ModelConfig, batch: int, seq: int, device, dtype, masked: bool):
    """The layer's GEMMs and attention at its shapes, each input its own leaf (no gradient
    sums, no copies, no elementwise pass in between)."""
    h, f, heads = config.hidden_size, config.intermediate_size, config.num_attention_heads
    tokens, d = batch * seq, config.head_dim

    def leaf(*shape):
        return (torch.randn(*shape, device=device, dtype=dtype) * 0.02).requires_grad_()

    linears = [(leaf(tokens, h), leaf(h, h)) for _ in range(4)]  # Q, K, V, attention output
    linears += [(leaf(tokens, h), leaf(f, h)), (leaf(tokens, f), leaf(h, f))]  # FFN in, out
    qkv_leaves = [leaf(batch, seq, heads, d) for _ in range(3)]  # B x S x h x d
    qkv = [t.transpose(1, 2) for t in qkv_leaves]  # B x h x S x d views, as in the layer
    key_mask = torch.ones(batch, 1, 1, seq, dtype=torch.bool, device=device) if masked else None
    grads = [torch.ones(tokens, w.shape[0], device=device, dtype=dtype) for _, w in linears]
    grads.append(torch.ones_like(qkv[0]))

    def step() -> None:
        outs = [F.linear(x, w) for x, w in linears]
        outs.append(F.scaled_dot_product_attention(*qkv, attn_mask=key_mask))
        torch.autograd.backward(outs, grads)
        for t in (*(t for pair in linears for t in pair), *qkv_leaves):
            t.grad = None  # fresh gradients each step, as the layers' zero_grad
    return step


def measure(config: ModelConfig, shape: dict, device, dtype, sync) -> tuple[dict, bool]:
    """One configuration: checks, then ms per layer of eager, compiled and the matmuls alone;
    whether every check passed."""
    batch, seq, layers, iters = shape["batch"], shape["seq"], shape["layers"], shape["iters"]
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, seq, config.hidden_size, device=device, generator=g).to(dtype)
    grad = torch.randn(x.shape, device=device, generator=g).to(dtype)
    masked = shape["masked"]
    key_mask = torch.ones(batch, seq, dtype=torch.bool, device=device) if masked else None
    print(f"\n{config.attention_backend}, dropout {config.hidden_dropout_prob}, "
          f"{'masked' if masked else 'flash'} path")
    steps = {name: layer_step(layer_stack(config.replace(compile=compiled), layers, device,
                                          dtype), x, key_mask, grad)
             for name, compiled in (("eager", False), ("compiled", True))}
    tp_random.seed_all(1)  # with dropout: the same masks on both streams
    eager_out = steps["eager"]()
    tp_random.seed_all(1)
    counters.clear()
    start = time.perf_counter()
    compiled_out = steps["compiled"]()
    sync()
    breaks = dict(counters["graph_break"])
    print(f"compiled: {counters['stats']['unique_graphs']} graph(s) for {layers} layer(s), "
          f"{sum(breaks.values())} graph break(s) {breaks or ''}(first step, compiling: "
          f"{time.perf_counter() - start:.1f} s)")
    error = ((compiled_out.float() - eager_out.float()).abs().max()
             / eager_out.float().abs().max()).item()
    limit = 1e-4 if dtype == torch.float32 else 5e-2
    print(f"compiled against eager: max relative difference {error:.2e} "
          f"({'ok' if error <= limit else 'FAIL'}, limit {limit:g})")

    steps["matmuls"] = matmuls_step(config, batch, seq, device, dtype, masked)
    seconds = seconds_per_step(steps, iters, sync)
    ms = {name: 1e3 * t / (1 if name == "matmuls" else layers) for name, t in seconds.items()}
    flops = layer_training_flops(config, seq) * batch * seq
    print(f"{'':<10}{'ms/layer':>10}{'TFLOP/s':>10}{'outside matmuls':>17}")
    for name, value in ms.items():
        outside = f"{1 - ms['matmuls'] / value:>16.1%}" if name != "matmuls" else ""
        print(f"{name:<10}{value:>10.3f}{flops / value / 1e9:>10.3g} {outside}")
    print(f"compiled / eager speed-up: {ms['eager'] / ms['compiled']:.3f}x")
    return ms, error <= limit and not breaks


def run(args) -> dict[tuple[str, float], dict]:
    """Every (attention backend, dropout) of the arguments; exits 1 if a check failed."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    gpu = device.type == "cuda"
    dtype_name = args.dtype or ("bf16" if gpu else "fp32")
    shape = dict(batch=args.batch or (16 if gpu else 2), seq=args.seq or (512 if gpu else 128),
                 layers=args.layers or (4 if gpu else 1), iters=args.iters or (10 if gpu else 3),
                 masked=args.masked)
    backends = (args.attention_backend or ("sdpa,fused_softmax" if gpu else "sdpa")).split(",")
    dropouts = [float(p) for p in (args.dropout or ("0,0.1" if gpu else "0")).split(",")]
    sync = device_sync(device)
    base = get_preset(args.preset)
    print(f"{device.type} {torch.cuda.get_device_name() if gpu else ''} torch {torch.__version__}"
          f" | {args.preset} layer (H {base.hidden_size}, {base.num_attention_heads} heads, "
          f"FFN {base.intermediate_size}), {dtype_name}, {shape['batch']} x {shape['seq']}, "
          f"{shape['layers']} layer(s)")
    results, ok = {}, True
    for backend in backends:
        for p in dropouts:
            config = base.replace(attention_backend=backend, hidden_dropout_prob=p,
                                  attention_probs_dropout_prob=p)
            results[backend, p], passed = measure(config, shape, device, DTYPES[dtype_name],
                                                  sync)
            ok &= passed
    if args.json:  # bench/gpu_table.py: the first configuration (sdpa at dropout 0 on a GPU)
        ms = next(iter(results.values()))
        write_json(args.json, {"eager_ms": ms["eager"], "compiled_ms": ms["compiled"],
                               "matmuls_ms": ms["matmuls"],
                               "speedup": ms["eager"] / ms["compiled"]})
    if not ok:
        raise SystemExit(1)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="rembert")
    p.add_argument("--batch", type=int, default=0, help="default: 16 on a GPU, 2 on CPU")
    p.add_argument("--seq", type=int, default=0, help="default: 512 on a GPU, 128 on CPU")
    p.add_argument("--dtype", choices=DTYPES, help="default: bf16 on a GPU, fp32 on CPU")
    p.add_argument("--layers", type=int, default=0, help="default: 4 on a GPU, 1 on CPU")
    p.add_argument("--iters", type=int, default=0, help="steps a round (5 rounds); "
                   "default: 10 on a GPU, 3 on CPU")
    p.add_argument("--masked", action="store_true", help="attention with a key mask")
    p.add_argument("--dropout", help="hidden and attention dropout, comma-separated; "
                   "default: 0,0.1 on a GPU, 0 on CPU")
    p.add_argument("--attention-backend", help="sdpa and/or fused_softmax, comma-separated; "
                   "default: both on a GPU, sdpa on CPU")
    p.add_argument("--cpu", action="store_true", help="on the CPU even where CUDA is present")
    p.add_argument("--json", help="write the first configuration's figures there "
                   "(bench/gpu_table.py)")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
