"""Ours against transformers' RemBertForMaskedLM at the real model's proportions, on CPU.

bench/train_throughput.py uses 2 layers of H 512 under the full 250k head, which makes the head
dominate and flatters the sparse head. Here every shape is the `rembert` preset's (H 1152, 18
heads, FFN 4608, E_in 256, E_out 1664, V 250,300, sequence 512, P = 80 predictions per
sequence), only the layer count is cut (--layers, default 2). In one run, one model after the
other (each holds ~8 GiB in fp32 with its AdamW states):
  hf    transformers.RemBertForMaskedLM, labels -100 except the masked positions (its head
        projects every position onto the vocabulary) + torch.optim.AdamW(fused=True)
  ours  RemBertForPreTraining (head and loss at the P masked slots, chunked fused loss) + the
        same AdamW (fused, as the trainer builds it)
Per model: seconds per step (median after a warm-up step), split into forward + backward and
the optimizer step; tokens/s; the matmul FLOPs it executes per step (ours: with the loss's
logits recomputation in backward for the rows whose logits it does not keep,
model.loss_keep_logits_gib; hf: its head on all S positions) as FLOP/s and as a fraction
of this machine's GEMM peak, measured in the same run (a 2048^3 matmul and the model's own GEMM
shapes, best of 3 before and 3 after the models). Also the loss alone (our head + fused loss,
forward + backward).

    python -m bench.real_proportions [--layers 2] [--batch 4] [--steps 2] [--threads N]
                                     [--malloc heap|hugetlb|default|env]
                                     [--preset rembert] [--seq 512]

On CPU every step allocates parameter-sized gradients afresh, and with glibc's defaults each
buffer over 32 MiB is a new mapping whose 4 KiB pages fault and are zeroed on first touch (the
1.55 GiB grad of the output embedding is 400k faults: about a second of our loss's backward).
`--malloc` picks glibc's settings (GLIBC_TUNABLES, read at start: the script runs itself again
under them), for both models alike:
  default  glibc's own;
  hugetlb  transparent huge pages for large buffers (glibc >= 2.35): 512x fewer faults;
  heap     (the default) hugetlb, and every buffer from the heap, which keeps what is freed
           (mmap_max=0, a 64 GiB trim threshold): a step reuses the pages of the last one.
  env      GLIBC_TUNABLES as the environment has it.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

from bench.common import hf_labels, make_batch
from megatron_rembert.config import get_preset
from megatron_rembert.data.masking import default_max_predictions
from megatron_rembert.kernels.cross_entropy_tiling import recomputed_rows
from megatron_rembert.model.partition import pipeline_layer_flops
from megatron_rembert.model.rembert import RemBertForPreTraining

# The smallest run (seconds): the tiny preset's shapes, one layer, one timed step, glibc's
# allocator as it is (tests/bench/test_every_bench.py).
TINY_ARGS = ["--preset", "tiny", "--seq", "64", "--layers", "1", "--batch", "1", "--steps", "1",
             "--malloc", "env"]
MALLOC = {"default": "", "hugetlb": "glibc.malloc.hugetlb=1",
          "heap": "glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:"
                  "glibc.malloc.trim_threshold=68719476736"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2, help="Transformer layers (rembert has 32)")
    p.add_argument("--batch", type=int, default=4,
                   help="sequences of 512 tokens per step (default 4: configs/rembert.yaml's "
                        "micro-batch is 16, which hf's full logits cannot hold here; at 1 the "
                        "fixed per-step costs of 480M embedding and head parameters dominate)")
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--malloc", choices=[*MALLOC, "env"], default="heap",
                   help="glibc allocator settings for the whole run (default heap; see above)")
    p.add_argument("--preset", default="rembert", help="the model's shapes (default rembert)")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence (default 512)")
    return p.parse_args(argv)


def gemm_rate(m: int, k: int, n: int, repeats: int = 3) -> float:
    """Best FLOP/s of an (m x k) @ (k x n) fp32 matmul."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best


def gemm_peak(config, tokens: int, rows: int) -> dict[str, float]:
    h, f, e, v = (config.hidden_size, config.intermediate_size, config.output_embedding_size,
                  config.vocab_size)
    shapes = {"2048^3": (2048, 2048, 2048), f"QKVO {tokens}x{h}x{h}": (tokens, h, h),
              f"FFN in {tokens}x{h}x{f}": (tokens, h, f),
              f"FFN out {tokens}x{f}x{h}": (tokens, f, h),
              f"logits chunk {rows}x{e}x{v // 8}": (rows, e, v // 8)}
    return {name: gemm_rate(*shape) for name, shape in shapes.items()}


def executed_flops(config, batch: int, seq: int, predictions: int, full_head: bool) -> float:
    """Matmul FLOPs of one training step: ours (pipeline_layer_flops: the head on its P slots
    with the logits recomputed in backward, less the recomputation of the rows whose logits
    the loss keeps, model.loss_keep_logits_gib) or hf's (its head on all positions, no
    recomputation)."""
    per_sequence = pipeline_layer_flops(config, seq, predictions, recompute=False)
    h, e, v = config.hidden_size, config.output_embedding_size, config.vocab_size
    if full_head:
        per_sequence[-1] = 3 * 2 * seq * (h * e + e * v)
        return batch * sum(per_sequence)
    rows = batch * predictions
    kept = rows - recomputed_rows(rows, config.padded_vocab_size(), e, 4,  # fp32 here
                                  config.loss_keep_logits_gib, config.loss_chunk_rows or None)
    return batch * sum(per_sequence) - 2 * e * v * kept


def time_steps(model, loss_fn, batches) -> dict[str, float]:
    # fused: what the trainer builds (training/optim.py); the default (foreach) allocates
    # parameter-sized temporaries and took 3.8 s of a 6.9 s step here at 2 layers
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    fwd_bwd, opt = [], []
    for i, batch in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss_fn(model, batch).backward()
        middle = time.perf_counter()
        optimizer.step()
        end = time.perf_counter()
        if i:  # the first step is a warm-up (allocations, optimizer state)
            fwd_bwd.append(middle - start)
            opt.append(end - middle)
    fb, o = statistics.median(fwd_bwd), statistics.median(opt)
    return {"step": fb + o, "forward+backward": fb, "optimizer": o}


def head_loss_time(config, rows: int, repeats: int = 2) -> float:
    """Our MLM head + fused loss alone, forward + backward on `rows` masked rows."""
    from megatron_rembert.model.mlm_head import MLMHead
    from megatron_rembert.parallel.layers import init_weights

    head = MLMHead(config)
    # parameters are made with torch.empty: without this they hold whatever the allocator
    # hands back (with --malloc heap, old floats, denormals among them: slow arithmetic)
    init_weights(head, 0, config.initializer_range, "mlm_head.")
    hidden = torch.randn(rows, config.hidden_size, requires_grad=True)
    labels = torch.randint(0, config.vocab_size, (rows,))
    weights = torch.ones(rows)
    times = []
    for _ in range(repeats + 1):
        head.zero_grad(set_to_none=True)  # as a training step: fresh gradients, no accumulation
        hidden.grad = None
        start = time.perf_counter()
        head(hidden, labels, weights).loss_sum.backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def run_under_malloc(choice: str, argv: list[str]) -> None:
    """Runs this script again with GLIBC_TUNABLES for `choice` unless it already has them."""
    if choice == "env" or os.environ.get("GLIBC_TUNABLES", "") == MALLOC[choice]:
        return
    env = {**os.environ, "GLIBC_TUNABLES": MALLOC[choice]}
    os.execve(sys.executable, [sys.executable, "-m", "bench.real_proportions", *argv], env)


def main(argv=None) -> int:
    args = parse_args(argv)
    if argv is None:
        run_under_malloc(args.malloc, sys.argv[1:])
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    from megatron_rembert.convert.hf import hf_config_dict, to_hf_state_dict

    config = get_preset(args.preset).replace(num_hidden_layers=args.layers)
    seq = args.seq
    predictions = default_max_predictions(seq)
    tokens = args.batch * seq
    batches = [make_batch(config, args.batch, seq, s, "cpu") for s in range(args.steps + 1)]
    for b in batches:  # make_batch masks 15% (77 slots); the data pipeline's P is 80
        assert b["masked_positions"].shape[1] <= predictions
    before = gemm_peak(config, tokens, 128)

    torch.manual_seed(0)
    ours = RemBertForPreTraining(config)
    ours.init_weights(0)
    hf_state = to_hf_state_dict(ours.state_dict(), config)

    def our_loss(model, b):
        out = model(**b)
        return out.loss_sum / out.num_tokens

    def hf_loss(model, b):
        return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                     token_type_ids=b["token_type_ids"], labels=hf_labels(b)).loss

    results = {"ours": time_steps(ours, our_loss, batches)}
    rows = batches[0]["masked_positions"].numel()
    del ours
    gc.collect()
    # timed with our model freed: with its 8 GiB still held it read 4.5-4.75 s against 3.5 here
    loss_alone = head_loss_time(config, rows)
    hf = transformers.RemBertForMaskedLM(transformers.RemBertConfig(**hf_config_dict(config)))
    hf.load_state_dict(hf_state)  # the same weights
    del hf_state
    results["hf"] = time_steps(hf, hf_loss, batches)
    del hf
    # measured again after the models: on a shared machine the rate moves by 1.5x within
    # minutes, and a peak taken in a slow moment would inflate every fraction below
    after = gemm_peak(config, tokens, 128)
    peaks = {name: max(before[name], after[name]) for name in before}
    peak = max(peaks.values())

    print(f"{args.preset} shapes, {args.layers} layers, batch {args.batch} x {seq} tokens, "
          f"{rows // args.batch} masked slots per sequence, fp32, {torch.get_num_threads()} "
          f"threads; GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}")
    print("GEMM FLOP/s (fp32, best of 3 before and 3 after the models): " + "; ".join(
        f"{name} {rate / 1e9:.1f} G" for name, rate in peaks.items()))
    print(f"2048^3 before / after: {before['2048^3'] / 1e9:.1f} / {after['2048^3'] / 1e9:.1f} G")
    print(f"{'model':<5} {'s/step':>7} {'fwd+bwd':>8} {'optimizer':>9} {'tokens/s':>9} "
          f"{'GFLOP/step':>10} {'GFLOP/s':>8} {'of peak':>8} {'fwd+bwd of peak':>16}")
    for name, r in results.items():
        flops = executed_flops(config, args.batch, seq, rows // args.batch, name == "hf")
        print(f"{name:<5} {r['step']:7.2f} {r['forward+backward']:8.2f} {r['optimizer']:9.2f} "
              f"{tokens / r['step']:9.1f} {flops / 1e9:10.1f} {flops / r['step'] / 1e9:8.1f} "
              f"{flops / r['step'] / peak:8.1%} {flops / r['forward+backward'] / peak:16.1%}")
    print(f"ratio ours / hf (tokens/s): {results['hf']['step'] / results['ours']['step']:.2f}x")
    print(f"our loss alone (head + fused loss, forward + backward, {rows} rows): "
          f"{loss_alone:.2f} s = {loss_alone / results['ours']['forward+backward']:.0%} of our "
          f"forward + backward; the optimizer is "
          f"{results['ours']['optimizer'] / results['ours']['step']:.0%} of our step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
