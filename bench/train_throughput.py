"""Training tokens/s: ours against transformers' RemBertForMaskedLM + torch AdamW, one process.

Same configuration (a few small layers, the full 250,300 vocabulary, E_in 256, E_out 1664),
same batches, same process, measured side by side:
  hf         transformers.RemBertForMaskedLM, labels -100 except the masked positions,
             torch.optim.AdamW (it projects every position onto the 250k vocabulary)
  ours-model RemBertForPreTraining (head and loss only at masked positions, fused chunked
             linear + cross-entropy) with the same default torch.optim.AdamW: the model alone
  ours       the same with our optimizer (training.optim.build_optimizer: fused AdamW)
  ours+ds    the trainer's real step: DeepSpeed engine (1 gloo rank, fp32, as
             configs/demo.yaml and tiny.yaml train) around ours, on the trainer's gradient
             path (parallel/grad_buffer.py, training/distributed_optimizer.py).
The ratio ours / hf is printed last.

On a GPU it also reports tokens/s, TFLOP/s and MFU of the `rembert` preset (bf16, our model and
torch's fused AdamW), with attention on the flash path (unpadded batches: SDPA without a mask)
and on the masked path (the all-ones mask passed on, as before the flash path), and their
ratio. `--gpu-only` skips the CPU comparison; that part needs only torch and
triton (no DeepSpeed, transformers or PyYAML), so it runs on a bare GPU image. `--trainer`
measures the trainer's real step instead (DeepSpeed, bf16, gradient accumulation, one GPU),
with its peak memory against train.py --dry-run's estimate. `--engine` measures what the engine
costs: the trainer's step (training.engine.Trainer in the precision given) against the bare
model + torch's fused AdamW (after clipping the gradient as the trainer
does) on the same batches, at each accumulation in `--engine-gas`, with the parts of the bare
step (forward + backward per micro-batch, optimizer).

    python -m bench.train_throughput [--steps 3] [--batch 16] [--seq 128] [--gpu-only]
    python -m bench.train_throughput --trainer [--gpu-batch 16] [--gas 2] [--steps 3]
    python -m bench.train_throughput --engine [--precision bf16] [--engine-gas 1 8]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import device_sync, hf_labels, make_batch, timed, write_json
from megatron_rembert.config import ModelConfig, get_preset
from megatron_rembert.launch_env import LaunchEnv, launch_env, publish
from megatron_rembert.model.rembert import RemBertForPreTraining
from megatron_rembert.model.sizes import flops_per_token
from megatron_rembert.train import end_process_groups, exit_now

ROOT = Path(__file__).resolve().parents[1]
# The smallest run (seconds, CPU): the trainer against the bare model, tiny preset, one step
# at gas 1 and 2 (tests/bench/test_gpu_table.py checks its figures).
TINY_ARGS = ["--engine", "--engine-preset", "tiny", "--batch", "2", "--seq", "32",
             "--engine-gas", "1", "2", "--steps", "1", "--json", "{tmp}/engine.json"]


def bench_config() -> ModelConfig:
    return ModelConfig(vocab_size=250_300, hidden_size=512, num_hidden_layers=2,
                       num_attention_heads=8, intermediate_size=2048, input_embedding_size=256,
                       output_embedding_size=1664)


def cpu_comparison(args) -> None:
    import transformers

    from megatron_rembert.convert.hf import hf_config_dict, to_hf_state_dict
    from megatron_rembert.run_config.schema import Config
    from megatron_rembert.training.optim import build_optimizer

    torch.manual_seed(0)
    config = bench_config()
    batches = [make_batch(config, args.batch, args.seq, s, "cpu") for s in range(args.steps + 1)]
    tokens = args.batch * args.seq

    ours = RemBertForPreTraining(config)
    ours.init_weights(0)
    hf = transformers.RemBertForMaskedLM(transformers.RemBertConfig(**hf_config_dict(config)))
    hf.load_state_dict(to_hf_state_dict(ours.state_dict(), config))  # same weights

    def train_step(model, optimizer, loss_fn):
        def step(batch):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            optimizer.step()
        return step

    def hf_loss(model, b):
        return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                     token_type_ids=b["token_type_ids"], labels=hf_labels(b)).loss

    def our_loss(model, b):
        out = model(**b)
        return out.loss_sum / out.num_tokens

    results = {}
    with torch.no_grad():  # the two models agree before we time them
        diff = abs(hf_loss(hf, batches[0]).item() - our_loss(ours, batches[0]).item())
    results["hf"] = timed(train_step(hf, torch.optim.AdamW(hf.parameters(), lr=1e-4), hf_loss),
                          batches, lambda: None)
    del hf
    results["ours-model"] = timed(train_step(ours, torch.optim.AdamW(ours.parameters(),
                                                                      lr=1e-4), our_loss),
                                  batches, lambda: None)
    results["ours"] = timed(train_step(ours, build_optimizer(ours, Config(model=config)),
                                       our_loss), batches, lambda: None)
    del ours
    results["ours+ds"] = deepspeed_step_time(config, batches)

    print(f"config: {config.num_hidden_layers} layers, H {config.hidden_size}, V "
          f"{config.vocab_size:,}, E_in {config.input_embedding_size}, E_out "
          f"{config.output_embedding_size}; batch {args.batch} x {args.seq} tokens, 15% masked; "
          f"{torch.get_num_threads()} threads; initial loss difference {diff:.1e}")
    print(f"{'variant':<11} {'s/step':>8} {'tokens/s':>10}")
    for name, seconds in results.items():
        print(f"{name:<11} {seconds:8.3f} {tokens / seconds:10,.0f}")
    print(f"ratio ours-model / hf (same optimizer): {results['hf'] / results['ours-model']:.2f}x")
    print(f"ratio ours+ds / hf (DeepSpeed engine step): {results['hf'] / results['ours+ds']:.2f}x")
    print(f"ratio ours / hf (model + our optimizer): {results['hf'] / results['ours']:.2f}x")


def deepspeed_step_time(config: ModelConfig, batches: list[dict]) -> float:
    """The trainer's real step (training.engine.Trainer) on one gloo rank."""
    import deepspeed

    from megatron_rembert.parallel import state
    from megatron_rembert.run_config.schema import Config, TrainConfig
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.plan import RunPlan

    publish(LaunchEnv(master_port=launch_env(default_port=29591).master_port))  # one process
    deepspeed.init_distributed(dist_backend="gloo")
    b = batches[0]["input_ids"].shape[0]
    run = Config(model=config, train=TrainConfig(global_batch_size=b, micro_batch_size=b,
                                                  precision="fp32", seed=0))
    run.optim.lr, run.optim.warmup_steps, run.parallel.zero_stage = 1e-4, 1, 1
    plan = RunPlan.build(run, 1)  # one process, one micro-batch per step
    state.initialize_model_parallel(plan.layout)
    trainer = Trainer(run, plan, device=torch.device("cpu"))
    seconds = timed(lambda batch: trainer.train_step([batch]), batches, lambda: None)
    trainer.wait_for_weights()  # the last step's all-gather (parallel.overlap_weight_gather)
    return seconds


def bare_step_time(config: ModelConfig, dtype: torch.dtype, mixed: bool,
                   batches: list[list[dict]], steps: int, device: torch.device, sync,
                   clip: float) -> tuple[float, dict]:
    """Seconds per step of the bare model + torch's fused AdamW, and the median of its parts.
    The gradient is clipped to norm `clip` first (torch's foreach clip_grad_norm_), as the
    trainer clips it: the same optimizer step.

    mixed=False: the model in `dtype`, gradients accumulated by autograd, AdamW on the
    parameters themselves (bf16 weights and moments: a lower bound, not a recipe anyone
    trains with). mixed=True: the plain mixed-precision loop without an engine (fp32 master
    weights and moments; after the micro-batches each gradient converted to fp32, AdamW on
    the masters, the weights copied back), the work any bf16 trainer must do per step."""
    model = RemBertForPreTraining(config)
    model.init_weights(0)
    model = model.to(device=device, dtype=dtype)
    params = list(model.parameters())
    masters = [p.detach().float() for p in params] if mixed else params
    optimizer = torch.optim.AdamW(masters, lr=1e-4, fused=True)
    parts = {"forward + backward": [], "optimizer": []}

    def step(micro_batches):
        tokens = sum(float(mb["masked_weights"].sum()) for mb in micro_batches)
        for mb in micro_batches:
            start = time.perf_counter()
            out = model(**{k: v if k == "unpadded" else v.to(device) for k, v in mb.items()})
            (out.loss_sum / tokens).backward()
            sync()
            parts["forward + backward"].append(time.perf_counter() - start)
        start = time.perf_counter()
        if mixed:
            for master, p in zip(masters, params, strict=True):
                master.grad = p.grad.float()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(masters, clip, foreach=True)
        optimizer.step()
        if mixed:
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
            optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        sync()
        parts["optimizer"].append(time.perf_counter() - start)

    seconds = timed(step, batches, sync)
    return seconds, {k: statistics.median(v[len(v) // (steps + 1):]) for k, v in parts.items()}


def engine_run_config(config: ModelConfig, precision: str, micro: int, gas: int, seq: int):
    """The trainer's run config for the engine bench: `precision`, one process, `gas`
    micro-batches of `micro` x `seq` per step."""
    from megatron_rembert.run_config.schema import Config, TrainConfig

    run = Config(model=config, train=TrainConfig(
        global_batch_size=micro * gas, micro_batch_size=micro, precision=precision, seed=0))
    run.data.seq_length = seq
    run.optim.lr, run.optim.warmup_steps, run.parallel.zero_stage = 1e-4, 1, 1
    return run


def engine_comparison(config: ModelConfig, precision: str, micro: int, seq: int,
                      gas_values: list[int], steps: int, device: torch.device) -> list[dict]:
    """Seconds per step of the trainer (DeepSpeed, production config of `precision`) and of the
    bare model + fused AdamW, on the same batches, for each accumulation in `gas_values`;
    medians over `steps` timed steps after one warm-up. One process (gloo on CPU, NCCL on a
    GPU)."""
    import gc

    from megatron_rembert.parallel import state
    from megatron_rembert.training.distributed import setup_distributed
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.metrics import memory_gib, peak_flops
    from megatron_rembert.training.plan import RunPlan

    setup_distributed(launch_env(default_port=29593), 10.0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    sync = device_sync(device)
    results = []
    for gas in gas_values:
        batches = [[make_batch(config, micro, seq, step * gas + i, "cpu") for i in range(gas)]
                   for step in range(steps + 1)]  # on the host, as the loader delivers them
        run = engine_run_config(config, precision, micro, gas, seq)
        bare_rows = {}
        for mixed in ([False, True] if dtype != torch.float32 else [False]):
            bare_rows[mixed] = bare_step_time(config, dtype, mixed, batches, steps, device, sync,
                                              run.optim.clip_grad)
            gc.collect()
        bare, bare_parts = bare_rows[False]
        plan = RunPlan.build(run, 1)
        state.initialize_model_parallel(plan.layout)
        trainer = Trainer(run, plan, device)
        engine = timed(trainer.train_step, batches, sync)
        tokens_per_s = micro * gas * seq / engine
        tflops = flops_per_token(config, seq)["training"] * tokens_per_s / 1e12
        peak = peak_flops(device)
        results.append({"gas": gas, "bare": bare, "trainer": engine,
                        "bare_mixed": bare_rows[True][0] if True in bare_rows else None,
                        "wrapper": type(trainer.optimizer).__name__, **bare_parts,
                        "trainer_metrics": {"tokens_per_s": tokens_per_s, "tflops": tflops,
                                            "mfu": tflops * 1e12 / peak if peak else None,
                                            "memory_gib": memory_gib(device)},
                        "sync_debug": (micro_batches_sync_check(trainer, batches[0])
                                       if device.type == "cuda" else None)})
        trainer.wait_for_weights()  # the last step's all-gather, before the next Trainer
        del trainer
        gc.collect()
    return results


def micro_batches_sync_check(trainer, micro_batches: list[dict]) -> str:
    """"clean" if the trainer's micro-batches (first forward to last backward) make no call that
    waits for the GPU, under torch.cuda.set_sync_debug_mode("error"); else CUDA's first
    complaint. Then the step's optimizer step (which reads the gradient norm once)."""
    prepared, context = trainer._prepare(micro_batches)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.forward_backward(prepared, context)
        verdict = "clean"
    except RuntimeError as err:
        verdict = str(err).strip().splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    trainer.optimizer_step()
    return verdict


def engine_report(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.engine_preset:
        config = get_preset(args.engine_preset)
    else:
        config = get_preset("rembert") if device.type == "cuda" else bench_config()
    micro, seq = (args.gpu_batch, 512) if device.type == "cuda" else (args.batch, args.seq)
    rows = engine_comparison(config, args.precision, micro, seq, args.engine_gas, args.steps,
                             device)
    print(f"engine cost, {device.type}: {config.num_hidden_layers} layers, H "
          f"{config.hidden_size}, V {config.vocab_size:,}; micro-batch {micro} x {seq}, "
          f"{args.precision}; medians of {args.steps} steps")
    print(f"{'gas':>4} {'fwd+bwd/mb':>11} {'bare opt':>9} {'bare step':>10} {'bare mp':>8} "
          f"{'trainer':>9} {'bare/trainer':>13} {'bare mp/trainer':>16}  (seconds; trainer "
          "optimizer)")
    for r in rows:
        mixed = r["bare_mixed"]
        print(f"{r['gas']:>4} {r['forward + backward']:11.3f} {r['optimizer']:9.3f} "
              f"{r['bare']:10.3f} {mixed or float('nan'):8.3f} {r['trainer']:9.3f} "
              f"{r['bare'] / r['trainer']:12.3f}x "
              f"{(mixed or float('nan')) / r['trainer']:15.3f}x  ({r['wrapper']})")
    print(f"bare: the model in {args.precision} + fused AdamW on its own weights, the "
          "gradient clipped first as the trainer clips it"
          + ("; in bf16 weights and moments are bf16 (a lower bound); bare mp: the plain "
             "mixed-precision loop (fp32 masters, gradients converted once per step, weights "
             "copied back), what the engine replaces" if args.precision != "fp32" else ""))
    for r in rows:
        t = r["trainer_metrics"]
        mfu = "n/a" if t["mfu"] is None else f"{t['mfu']:.1%}"
        print(f"trainer, gas {r['gas']}: {t['tokens_per_s']:,.0f} tokens/s, {t['tflops']:.1f} "
              f"TFLOP/s, MFU {mfu}, memory {t['memory_gib']:.1f} GiB"
              + (f"; micro-batches under sync_debug_mode error: {r['sync_debug']}"
                 if r["sync_debug"] else ""))
    if args.json:  # bench/gpu_table.py
        sync = [r["sync_debug"] for r in rows if r["sync_debug"]]
        write_json(args.json, {"rows": rows,
                               "sync_debug": next((v for v in sync if v != "clean"),
                                                  "clean" if sync else None)})


def preset_throughput(preset: str, batch: int, seq: int, steps: int,
                      device: torch.device, unpadded: bool = True, compile: bool = False) -> dict:
    """One preset trained in bf16 with torch's fused AdamW: tokens/s, model TFLOP/s (the
    summary CLI's FLOPs), MFU where the GPU's peak is known, peak memory. `unpadded`: the
    batches say they hold no padding (attention without a mask: FlashAttention on CUDA), else
    they carry their all-ones mask to attention as before the flash path. `compile`:
    model.compile (the warm-up step pays the compilation)."""
    from megatron_rembert.training.metrics import memory_gib, peak_flops

    config = get_preset(preset).replace(compile=compile)
    model = RemBertForPreTraining(config).to(device)
    model.init_weights(0)
    model = model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = [make_batch(config, batch, seq, s, device) for s in range(steps + 1)]
    for b in batches:
        b["unpadded"].fill_(int(unpadded))

    def step(b):
        optimizer.zero_grad(set_to_none=True)
        out = model(**b)
        (out.loss_sum / out.num_tokens).backward()
        optimizer.step()

    sync = device_sync(device)
    tokens_per_s = batch * seq / timed(step, batches, sync)
    tflops = flops_per_token(config, seq)["training"] * tokens_per_s / 1e12
    peak = peak_flops(device)
    return {"tokens_per_s": tokens_per_s, "tflops": tflops,
            "mfu": tflops * 1e12 / peak if peak else None, "memory_gib": memory_gib(device)}


def trainer_throughput(preset: str, micro: int, gas: int, seq: int, steps: int) -> dict:
    """The trainer's real step on this one process: DeepSpeed with bf16, `gas` micro-batches
    of `micro` x `seq` per step, on the GPU with NCCL (else the CPU with gloo). tokens/s, model
    TFLOP/s, MFU, peak memory, and the memory `train.py --dry-run` estimates for this layout."""
    from megatron_rembert.parallel import state
    from megatron_rembert.run_config.load import load_config
    from megatron_rembert.training.distributed import setup_distributed
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.estimate import MEMORY_KEYS, memory_estimate
    from megatron_rembert.training.metrics import memory_gib, peak_flops
    from megatron_rembert.training.plan import RunPlan

    config = load_config(ROOT / "configs" / "rembert.yaml", [
        f"model.preset={preset}", "parallel.tp=1", "parallel.pp=1",
        f"train.micro_batch_size={micro}", f"train.global_batch_size={micro * gas}",
        f"data.seq_length={seq}", "optim.warmup_steps=1"])
    _, _, device = setup_distributed(launch_env(default_port=29592),
                                     config.parallel.timeout_minutes)
    plan = RunPlan.build(config, 1)
    state.initialize_model_parallel(plan.layout)
    trainer = Trainer(config, plan, device)
    batches = [[make_batch(config.model, micro, seq, step * gas + i, "cpu") for i in range(gas)]
               for step in range(steps + 1)]  # on the host, as the loader delivers them
    sync = device_sync(device)
    tokens_per_s = micro * gas * seq / timed(trainer.train_step, batches, sync)
    trainer.wait_for_weights()  # the last step's all-gather (parallel.overlap_weight_gather)
    tflops = flops_per_token(config.model, seq)["training"] * tokens_per_s / 1e12
    peak = peak_flops(device)
    estimate = memory_estimate(plan.stages)
    return {"tokens_per_s": tokens_per_s, "tflops": tflops,
            "mfu": tflops * 1e12 / peak if peak else None, "memory_gib": memory_gib(device),
            "estimate_gib": {k: estimate[k] / 2**30 for k in MEMORY_KEYS}}


def gpu_trainer(args) -> None:
    r = trainer_throughput("rembert", args.gpu_batch, args.gas, 512, args.steps)
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
    estimate = sum(r["estimate_gib"].values())
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{where}: trainer step (DeepSpeed, bf16, zero1_bf16.json), rembert, "
          f"{args.gas} x {args.gpu_batch} x 512 tokens: {r['tokens_per_s']:,.0f} tokens/s, "
          f"{r['tflops']:.1f} TFLOP/s, MFU {mfu}")
    print(f"peak memory {r['memory_gib']:.1f} GiB; --dry-run estimate {estimate:.1f} GiB ("
          + ", ".join(f"{k} {v:.1f}" for k, v in r["estimate_gib"].items())
          + f"); measured / estimate {r['memory_gib'] / estimate:.2f}")


def attention_paths(batch: int, seq: int, config: ModelConfig, repeats: int = 20) -> None:
    """Attention alone at the preset's shapes, forward + backward ms: SDPA without a mask (what
    the flash path calls; also forced to FlashAttention, which raises if the call is not
    eligible) against SDPA with the all-ones boolean mask (which FlashAttention refuses)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, dim = config.num_attention_heads, config.head_dim
    q, k, v = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    mask = torch.ones(batch, 1, 1, seq, device="cuda", dtype=torch.bool)
    grad = torch.randn_like(q)
    variants = {"no mask (auto)": (None, None), "no mask, FLASH forced": (None, "flash"),
                "all-ones mask (auto)": (mask, None)}
    for name, (attn_mask, forced) in variants.items():
        def step(_, attn_mask=attn_mask, forced=forced):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if forced else contextlib.nullcontext():
                F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).backward(grad)
        try:
            ms = 1e3 * timed(step, [None] * (repeats + 1), torch.cuda.synchronize)
            print(f"  attention {batch}x{heads}x{seq}x{dim} bf16 fwd+bwd, {name}: {ms:.3f} ms")
        except RuntimeError as exc:
            print(f"  attention, {name}: not available ({str(exc).splitlines()[0][:120]})")


def gpu_rembert(args) -> None:
    """tokens/s, TFLOP/s and MFU of the rembert preset on one GPU (bf16, fused AdamW), with
    attention on the flash path (unpadded batches, no mask) and on the masked path, and with
    --compile the flash path under model.compile."""
    results = {}
    variants = {"flash": (True, False), "masked": (False, False)}
    if args.compile:
        variants["flash + model.compile"] = (True, True)
    for name, (unpadded, compile) in variants.items():
        r = results[name] = preset_throughput("rembert", args.gpu_batch, 512, args.steps,
                                              torch.device("cuda"), unpadded, compile)
        torch.cuda.empty_cache()  # the model of this run is gone; the next one starts afresh
        torch.cuda.reset_peak_memory_stats()
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (GPU not in the peak table)"
        print(f"GPU {torch.cuda.get_device_name()}: rembert, batch {args.gpu_batch} x 512, "
              f"bf16, {name} path: {r['tokens_per_s']:,.0f} tokens/s, "
              f"{r['tflops']:.1f} TFLOP/s, MFU {mfu}, peak memory {r['memory_gib']:.1f} GiB")
    rate = {name: r["tokens_per_s"] for name, r in results.items()}
    print(f"flash / masked tokens/s: {rate['flash'] / rate['masked']:.3f}x")
    if args.json:  # bench/gpu_table.py
        write_json(args.json, {"variants": results, "best": max(rate, key=rate.get)})
    if args.compile:
        print(f"flash + model.compile / flash tokens/s: "
              f"{rate['flash + model.compile'] / rate['flash']:.3f}x")
    attention_paths(args.gpu_batch, 512, get_preset("rembert"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--gpu-batch", type=int, default=16)
    parser.add_argument("--gas", type=int, default=2,
                        help="micro-batches per step for --trainer")
    parser.add_argument("--gpu-only", action="store_true",
                        help="only the rembert preset on the GPU (torch and triton suffice)")
    parser.add_argument("--compile", action="store_true",
                        help="also the rembert step with model.compile (GPU)")
    parser.add_argument("--trainer", action="store_true",
                        help="only the trainer's step (DeepSpeed) for rembert on one GPU")
    parser.add_argument("--engine", action="store_true",
                        help="only the trainer's step against the bare model + fused AdamW")
    parser.add_argument("--engine-gas", type=int, nargs="+", default=[1, 8],
                        help="accumulation steps for --engine")
    parser.add_argument("--engine-preset", help="the model for --engine (default: rembert on "
                        "a GPU; on CPU 2 layers of H 512 under rembert's embeddings and head)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                        help="precision for --engine")
    parser.add_argument("--json", help="--gpu-only or --engine: write the figures there "
                        "(bench/gpu_table.py)")
    args = parser.parse_args(argv)
    if args.engine:
        engine_report(args)
        return
    if args.trainer:
        if not torch.cuda.is_available():
            sys.exit("--trainer: no CUDA device")
        gpu_trainer(args)
        return
    if torch.cuda.is_available():
        gpu_rembert(args)
    elif args.gpu_only:
        sys.exit("--gpu-only: no CUDA device")
    if not args.gpu_only:
        cpu_comparison(args)


if __name__ == "__main__":
    main()
    end_process_groups()
    exit_now(0)  # as train.py ends: not through the interpreter's teardown of gloo
