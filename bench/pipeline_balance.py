"""Pipeline balance, measured: each pipeline layer's forward + backward time on this device,
summed into the stages of this version's FLOP-balanced partition and of the parameter-balanced
partition of earlier versions, for pp = 2, 4, 8.

A 1F1B pipeline of m micro-batches takes (m - 1) x (slowest stage) + (sum of stages) per step
(fill and drain, `model.partition.one_f_one_b_efficiency`), so from the measured stage times
this prints, per layout and partition: the busiest stage's share of the time, tokens/s of one
pipeline, model TFLOP/s per GPU and MFU (bf16 peak), and the ratio new / old. The stage times
are measured here one layer at a time (one Transformer layer stands for all: they are equal),
in bf16 with every gradient going into fp32 main gradients as the trainer's do
(parallel/grad_buffer.py: the embedding and the loss add into them themselves);
the step times are projected from them and leave out the point-to-point sends, which move one
B x S x H activation per micro-batch and stage boundary.

    python -m bench.pipeline_balance [--preset rembert] [--micro-batches 8] [--pp 2,4,8]
                                     [--repeats 10] [--dtype bf16] [--device cuda]
                                     [--set KEY=VALUE ...]

Needs DeepSpeed for the old partition (its `partition_balanced`). On a GPU machine it is part
of bench/gpu_checks.sh; on CPU, e.g. `--device cpu --preset tiny --set data.seq_length=128`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.common import device_sync, make_batch, timed, write_json
from megatron_rembert.checkpoint.resume import parameter_balanced_boundaries
from megatron_rembert.model.pipeline import (
    EmbeddingPipe,
    MLMHeadPipe,
    TransformerLayerPipe,
    pipeline_inputs,
)
from megatron_rembert.model.sizes import flops_per_token
from megatron_rembert.parallel.grad_buffer import GradBuffer
from megatron_rembert.run_config.load import load_config
from megatron_rembert.training.metrics import peak_flops
from megatron_rembert.training.plan import RunPlan

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# The smallest run (seconds, CPU): tests/bench/test_every_bench.py.
TINY_ARGS = ["--device", "cpu", "--dtype", "fp32", "--preset", "tiny", "--pp", "2",
             "--repeats", "1", "--set", "data.seq_length=32", "--set", "train.micro_batch_size=2",
             "--set", "model.vocab_size=1000"]


def layer_times(config, micro: int, seq: int, predictions: int, masked: int, dtype, device,
                repeats: int) -> list[float]:
    """Forward + backward milliseconds of one micro-batch through the embedding, one Transformer
    layer and the head, as the pipeline runs them (the flash path: packed batches are unpadded;
    `masked` of the P slots real, the rest weight 0, as a full row at the schedule's largest
    rate), returned per pipeline layer (embedding, L layers, head)."""
    m = config.model
    batch = make_batch(m, micro, seq, 0, device, predictions)
    batch["masked_weights"][:, masked:] = 0.0
    inputs = pipeline_inputs(batch)
    embedding = EmbeddingPipe(m).to(device, dtype)
    layer = TransformerLayerPipe(m, 0).to(device, dtype)
    layer.unpadded = True  # the flash path, as the trainer tells the stages for packed rows
    head = MLMHeadPipe(m).to(device, dtype)
    buffer = None  # kept while the layers run: its hooks act while it lives
    if dtype == torch.bfloat16:  # gradients into fp32 main gradients, as the trainer's bf16
        buffer = GradBuffer([p for module in (embedding, layer, head)
                             for p in module.parameters()], dp_group=None)
    hidden, *rest = embedding(inputs)
    carried = (hidden.detach().requires_grad_(), *rest)
    grad = torch.randn_like(hidden)

    def run_embedding():
        embedding(inputs)[0].backward(grad)

    def run_layer():
        layer(carried)[0].backward(grad)

    def run_head():
        out = head(carried)
        (out.loss_sum / out.num_tokens).backward()

    sync = device_sync(device)
    ms = [1e3 * timed(lambda _, f=f: f(), [None] * (repeats + 1), sync)  # median after 1 warm-up
          for f in (run_embedding, run_layer, run_head)]
    del buffer  # the gradients are no longer needed
    return [ms[0]] + [ms[1]] * m.num_hidden_layers + [ms[2]]


def stages(bounds: list[int], per_layer: list[float]) -> list[float]:
    return [sum(per_layer[bounds[i]:bounds[i + 1]]) for i in range(len(bounds) - 1)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="rembert")
    parser.add_argument("--config", default=str(ROOT / "configs" / "rembert.yaml"))
    parser.add_argument("--micro-batches", type=int, default=8,
                        help="micro-batches per step and pipeline (m of 1F1B)")
    parser.add_argument("--pp", default="2,4,8", help="pipeline sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override, as train.py's (e.g. data.seq_length=128)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="write the layer times there (bench/gpu_table.py)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sizes = [int(p) for p in args.pp.split(",")]
    config = load_config(args.config, [f"model.preset={args.preset}", "parallel.tp=1",
                                       "parallel.pp=1", *args.set])
    micro, seq = config.train.micro_batch_size, config.data.seq_length
    data = RunPlan.build(config, 1).data
    predictions = data.max_predictions  # P, as the loader sizes it
    masked = data.training_masked_per_row(seq)
    per_layer = layer_times(config, micro, seq, predictions, masked, DTYPES[args.dtype], device,
                            args.repeats)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{where}, {args.preset} ({config.model.num_hidden_layers} layers), {args.dtype}, "
          f"micro-batch {micro} x {seq} tokens, P {predictions} ({masked} real); forward + "
          f"backward ms: embedding {per_layer[0]:.2f} (= {per_layer[0] / per_layer[1]:.3f} "
          f"layers), Transformer layer {per_layer[1]:.2f}, head {per_layer[-1]:.2f} (= "
          f"{per_layer[-1] / per_layer[1]:.2f} layers); m = {args.micro_batches} micro-batches "
          "per step")
    if args.json:  # bench/gpu_table.py
        write_json(args.json, {"embedding_ms": per_layer[0], "layer_ms": per_layer[1],
                               "head_ms": per_layer[-1]})
    flops = flops_per_token(config.model, seq)["training"] * micro * seq  # per micro-batch
    peak = peak_flops(device)
    m = args.micro_batches
    print(f"{'pp':>3} {'partition':<10} {'layers per stage':<22} {'stage ms':<28} "
          f"{'busiest':>7} {'tokens/s':>10} {'TFLOP/s/GPU':>11} {'MFU':>6}")
    for pp in sizes:
        config.parallel.pp = pp
        new = RunPlan.build(config, pp).stages.boundaries
        old = parameter_balanced_boundaries(config, pp)
        rates = {}
        for name, bounds in (("params", old), ("flops", new)):
            t = stages(bounds, per_layer)
            step_ms = (m - 1) * max(t) + sum(t)
            rates[name] = m * micro * seq / (step_ms / 1e3)
            per_gpu = m * flops / (step_ms / 1e3) / pp
            mfu = f"{per_gpu / peak:6.1%}" if peak else "   n/a"
            counts = [bounds[i + 1] - bounds[i] for i in range(pp)]
            print(f"{pp:>3} {name:<10} {'/'.join(map(str, counts)):<22} "
                  f"{'/'.join(f'{x:.0f}' for x in t):<28} {max(t) / sum(t):7.1%} "
                  f"{rates[name]:10,.0f} {per_gpu / 1e12:11.1f} {mfu}")
        print(f"    pp = {pp}: flops-balanced / parameter-balanced tokens/s "
              f"{rates['flops'] / rates['params']:.2f}x")


if __name__ == "__main__":
    main()
