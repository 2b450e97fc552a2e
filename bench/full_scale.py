"""The rembert model end to end on this machine's CPUs: tp 2 x pp 2 on 4 processes, fp32.

Stages (each timed; the memory of every process sampled from /proc by bench.memwatch):
  data        a 1 MB synthetic corpus, a SentencePiece tokenizer (`--tokenizer-vocab` pieces,
              smaller than the model's vocabulary: `data.allow_larger_vocab=true`), Arrow shards
  train       3 steps (seq 128, 4 micro-batches of 1), checkpoints at steps 2 and 3
  resume      roll back to step 2 (`train.resume_from`), 1 step: its loss must equal step 3's
  to-hf       `convert to-hf`; transformers loads the folder and its logits at masked positions
              equal ours (our model at tp = 1 on the checkpoint's weights)
  export      `convert export-encoder`; transformers' RemBertModel loads it; parameter count
Memory: each rank's peak RSS (RssAnon: what the process allocated) less the RssAnon of a process
that only imported the trainer, against `train.py --dry-run`'s estimate for its stage; each
conversion's peak against the largest single full tensor (the output embedding).

The model is the rembert preset (32 layers). On a machine whose memory cannot hold it,
`--layers auto` (the default) drops Transformer layers, and only those, until the dry-run
estimate (+15%, + the processes' own memory) fits in MemAvailable, and says so.
`--small` is the CI variant: 2 layers, a 16,000-piece model vocabulary.

    bench/full_scale.sh [--small] [--layers N|auto] [--out DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.memwatch import mem_available, watch
from megatron_rembert.checkpoint.step_folder import ROLLED_BACK

ROOT = Path(__file__).resolve().parents[1]
# The CI variant (minutes, 4 processes): tests/bench/test_full_scale.py checks its figures.
TINY_ARGS = ["--small", "--out", "{tmp}"]
GIB = 2**30
SEQ, MICRO, GLOBAL = 128, 1, 4
TRAIN_KEYS = [
    "parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1",
    "train.precision=fp32",
    f"data.seq_length={SEQ}", "data.allow_larger_vocab=true",
    f"train.micro_batch_size={MICRO}", f"train.global_batch_size={GLOBAL}",
    "train.steps=3", "train.save_interval=2", "train.keep_last=2", "train.eval_interval=0",
    "train.log_interval=1", "optim.warmup_steps=0", "optim.decay=constant",
]


def _python(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, check=True, **kw)


def import_baseline() -> int:
    """RssAnon of a process that imported what a training rank imports, and nothing else."""
    code = ("import deepspeed, torch, megatron_rembert.training.loop, pathlib\n"
            "print([l for l in pathlib.Path('/proc/self/status').read_text().splitlines()"
            " if l.startswith('RssAnon')][0].split()[1])")
    out = _python("-c", code, capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1]) * 1024


def config_for(layers: int, vocab: int | None, extra: list[str]):
    from megatron_rembert.run_config.load import load_config

    keys = TRAIN_KEYS + [f"model.num_hidden_layers={layers}"] + extra
    if vocab:
        keys.append(f"model.vocab_size={vocab}")
    return load_config(ROOT / "configs" / "rembert.yaml", keys), keys


def rank_estimates(config) -> dict[str, float]:
    """The dry-run estimate (bytes) of each rank: ranks are pp-major, tp-minor."""
    from megatron_rembert.training.plan import RunPlan

    stages = RunPlan.build(config, 4).stages
    return {f"rank {stage * 2 + t}": stages.total_memory(stage)
            for stage in range(2) for t in range(2)}


def pick_layers(vocab: int | None, overheads: dict[str, float], log) -> int:
    """The most layers (at most the preset's) whose estimate fits this machine's memory."""
    from megatron_rembert.config import get_preset

    full = get_preset("rembert").num_hidden_layers
    budget = mem_available() - sum(overheads.values()) - GIB  # 1 GiB for the page cache
    for layers in range(full, 1, -1):
        need = 1.15 * sum(rank_estimates(config_for(layers, vocab, [])[0]).values())
        if need <= budget:
            if layers < full:
                log(f"layers: {layers} of {full}: the estimate for more (+15%) exceeds the "
                    f"{budget / GIB:.1f} GiB this machine has free for tensors")
            return layers
    raise SystemExit("error: even 2 layers do not fit this machine's memory")


# A model of a few MB in the same layout and run: what a rank holds besides the model's tensors.
TINY = ["model.num_hidden_layers=2", "model.hidden_size=64", "model.num_attention_heads=2",
        "model.intermediate_size=256", "model.output_embedding_size=64", "model.vocab_size=1000",
        "train.steps=1", "train.save_interval=0"]


def rank_overheads(out: Path, keys: list[str]) -> dict[str, float]:
    """Each rank's peak RssAnon in a run of the TINY model, less that model's estimate: the
    interpreter, torch, DeepSpeed, gloo, the dataset and allocator slack; under "others" the
    peaks of the other processes (torchrun, loader workers) summed."""
    tiny = keys + TINY + [f"train.save_dir={out / 'checkpoints_tiny'}",
                          f"train.log_dir={out / 'logs_tiny'}"]
    from megatron_rembert.run_config.load import load_config

    estimates = rank_estimates(load_config(ROOT / "configs" / "rembert.yaml", tiny))
    peaks, _ = train(tiny, [])
    shutil.rmtree(out / "checkpoints_tiny", ignore_errors=True)
    return {**{rank: peaks[rank]["anon"] - estimates[rank] for rank in estimates},
            "others": sum(p["anon"] for k, p in peaks.items() if k not in estimates)}


def train(keys: list[str], extra: list[str]) -> tuple[dict, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "4", str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "rembert.yaml")]
    for key in keys + extra:
        cmd += ["--set", key]
    status, peaks, seconds = watch(cmd)
    if status != 0:
        raise SystemExit(f"error: training exited with {status} ({' '.join(extra)})")
    return peaks, seconds


def losses(log_dir: Path) -> dict[str, float]:
    """Training loss by step; the keys are strings, as in result.json."""
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {str(r["step"]): r["loss"] for r in rows if r.get("split") == "train"}


def convert(args: list[str]) -> tuple[dict, float]:
    status, peaks, seconds = watch([sys.executable, "-m", "megatron_rembert.convert", *args])
    if status != 0:
        raise SystemExit(f"error: convert {args[0]} exited with {status}")
    return max(p["anon"] for p in peaks.values()), seconds


def check_hf(step_dir: Path, hf_dir: Path, encoder_dir: Path) -> dict:
    """In its own process (its memory is not the conversions'): transformers' logits at masked
    positions against ours, and the encoder's parameter count."""
    code = f"""
import json, math, torch, transformers
from megatron_rembert.checkpoint.reader import CheckpointReader
from megatron_rembert.checkpoint.specs import ParamSpec
from megatron_rembert.checkpoint.step_folder import StepFolder
from megatron_rembert.model.rembert import RemBertForPreTraining
from megatron_rembert.parallel import state

torch.manual_seed(0)
with CheckpointReader(StepFolder.open({str(step_dir)!r})) as reader, state.offline(1):
    config = reader.model
    ours = RemBertForPreTraining(config).eval()
    for name, param in ours.named_parameters():
        full = reader.full_weight(ParamSpec.of(name, param, config.num_hidden_layers))
        with torch.no_grad():
            param[: full.shape[0]].copy_(full)
    data = reader.meta["config"]["data"]
manifest = json.load(open(data["path"] + "/manifest.json"))
pieces, mask_id = manifest["tokenizer"]["vocab_size"], manifest["special_ids"]["mask"]
ids = torch.randint(5, pieces, (2, {SEQ}))
positions = torch.stack([torch.randperm({SEQ} - 1)[:19] + 1 for _ in range(2)])
ids.scatter_(1, positions, mask_id)
mask, types = torch.ones_like(ids), torch.zeros_like(ids)
with torch.no_grad():
    hidden = ours.rembert(ids, mask, types)
    rows = hidden[torch.arange(2)[:, None], positions].reshape(-1, config.hidden_size)
    mine = ours.mlm_head.logits(rows)[:, : config.vocab_size]
    del ours
    hf = transformers.RemBertForMaskedLM.from_pretrained({str(hf_dir)!r}).eval()
    theirs = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    theirs = theirs[torch.arange(2)[:, None], positions].reshape(-1, config.vocab_size)
    del hf
encoder = transformers.RemBertModel.from_pretrained({str(encoder_dir)!r},
                                                   add_pooling_layer=False)
from safetensors import safe_open
with safe_open({str(encoder_dir / "model.safetensors")!r}, "pt") as f:
    in_file = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
print(json.dumps({{"max_abs_diff": (mine - theirs).abs().max().item(),
                  "max_abs_logit": theirs.abs().max().item(),
                  "encoder_parameters": in_file,
                  "encoder_loaded": sum(p.numel() for p in encoder.parameters())}}))
"""
    out = _python("-c", code, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def make_data(out: Path, tokenizer_vocab: int) -> None:
    if (out / "data" / "manifest.json").exists():
        return
    _python("data_tools/make_demo_corpus.py", "--out", str(out / "corpus"), "--size-mb", "1",
            stdout=subprocess.DEVNULL)
    _python("data_tools/train_tokenizer.py", "--corpus", str(out / "corpus"), "--out",
            str(out / "tokenizer" / "spm"), "--vocab-size", str(tokenizer_vocab),
            stdout=subprocess.DEVNULL)
    _python("data_tools/preprocess.py", "--corpus", str(out / "corpus"), "--tokenizer",
            str(out / "tokenizer" / "spm.model"), "--out", str(out / "data"), "--seq-length",
            str(SEQ), "--valid-fraction", "0.02", "--no-progress", stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true",
                        help="the CI variant: 2 layers, a 16,000-piece model vocabulary")
    parser.add_argument("--layers", default="auto",
                        help="Transformer layers (default auto: the preset's 32, or the most "
                             "that fit this machine's memory)")
    parser.add_argument("--out", default="full_scale_out", help="working folder")
    parser.add_argument("--keep", action="store_true", help="keep checkpoints and exports")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        notes.append(msg)

    vocab = 16000 if args.small else None
    times: dict[str, float] = {}
    start = time.perf_counter()
    make_data(out, 1000)
    times["data"] = time.perf_counter() - start
    baseline = import_baseline()
    paths = [f"data.path={out / 'data'}", f"data.tokenizer={out / 'tokenizer' / 'spm.model'}"]
    for folder in ("checkpoints", "logs_train", "logs_resume", "logs_tiny", "hf", "encoder"):
        shutil.rmtree(out / folder, ignore_errors=True)
    start = time.perf_counter()
    overheads = rank_overheads(out, config_for(2, vocab, paths)[1])
    times["calibration (the same run, a 2 MB model)"] = time.perf_counter() - start
    layers = (2 if args.small else pick_layers(vocab, overheads, log)) \
        if args.layers == "auto" else int(args.layers)
    config, keys = config_for(layers, vocab, paths + [f"train.save_dir={out / 'checkpoints'}"])
    from megatron_rembert.model.sizes import parameter_counts

    counts = parameter_counts(config.model)
    log(f"model: rembert preset, {layers} layers, vocabulary {config.model.vocab_size:,}: "
        f"{counts.pretraining:,} parameters in pre-training, {counts.finetuning:,} in "
        "fine-tuning")

    peaks, times["train (3 steps, 2 saves)"] = train(
        keys, [f"train.log_dir={out / 'logs_train'}"])
    step2 = out / "checkpoints" / "step_00000002"
    resumed, times["resume (load, 1 step, save)"] = train(
        keys, [f"train.log_dir={out / 'logs_resume'}", f"train.resume_from={step2}"])
    shutil.rmtree(out / "checkpoints" / ROLLED_BACK)  # the first step 3, moved aside
    reference, again = losses(out / "logs_train"), losses(out / "logs_resume")
    step3 = out / "checkpoints" / "step_00000003"
    hf_peak, times["convert to-hf"] = convert(
        ["to-hf", "--checkpoint", str(step3), "--out", str(out / "hf")])
    enc_peak, times["convert export-encoder"] = convert(
        ["export-encoder", "--checkpoint", str(step3), "--out", str(out / "encoder")])
    start = time.perf_counter()
    hf = check_hf(step3, out / "hf", out / "encoder")
    times["transformers check"] = time.perf_counter() - start

    estimates = rank_estimates(config)
    largest = config.model.padded_vocab_size(2) * config.model.output_embedding_size * 4
    result = {
        "layers": layers, "parameters": counts.pretraining, "encoder_expected": counts.finetuning,
        "baseline_gib": baseline / GIB, "times_s": times, "notes": notes,
        "losses": {"uninterrupted": reference, "resumed": again},
        "hf": hf, "largest_tensor_gib": largest / GIB,
        "ranks": {rank: {"estimate_gib": estimates[rank] / GIB,
                         "train_peak_gib": peaks[rank]["anon"] / GIB,
                         "resume_peak_gib": resumed[rank]["anon"] / GIB,
                         "overhead_gib": overheads[rank] / GIB,
                         "ratio": (max(peaks[rank]["anon"], resumed[rank]["anon"])
                                   - overheads[rank]) / estimates[rank]}
                  for rank in sorted(estimates)},
        "conversions": {"to-hf": {"peak_gib": hf_peak / GIB,
                                  "ratio": (hf_peak - baseline) / largest},
                        "export-encoder": {"peak_gib": enc_peak / GIB,
                                           "ratio": (enc_peak - baseline) / largest}},
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(report(result))
    if not args.keep:
        for folder in ("checkpoints", "hf", "encoder"):
            shutil.rmtree(out / folder, ignore_errors=True)
    return result


def report(r: dict) -> str:
    lines = [f"rembert, {r['layers']} layers, {r['parameters']:,} parameters; tp 2 x pp 2, "
             f"fp32, seq {SEQ}, ZeRO-1; process baseline (imports) {r['baseline_gib']:.2f} GiB",
             "", "| stage | seconds |", "|---|---:|"]
    lines += [f"| {k} | {v:.0f} |" for k, v in r["times_s"].items()]
    lines += ["", "| rank | dry-run estimate GiB | peak RSS train GiB | peak RSS resume GiB | "
              "overhead GiB | (peak - overhead) / estimate |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {k} | {v['estimate_gib']:.2f} | {v['train_peak_gib']:.2f} | "
              f"{v['resume_peak_gib']:.2f} | {v['overhead_gib']:.2f} | {v['ratio']:.2f} |"
              for k, v in r["ranks"].items()]
    lines += ["", f"| conversion | peak RSS GiB | (peak - baseline) / largest tensor "
              f"({r['largest_tensor_gib']:.2f} GiB) |", "|---|---:|---:|"]
    lines += [f"| {k} | {v['peak_gib']:.2f} | {v['ratio']:.2f} |"
              for k, v in r["conversions"].items()]
    step = max(r["losses"]["resumed"], key=int)
    a, b = r["losses"]["uninterrupted"][step], r["losses"]["resumed"][step]
    lines += ["", f"loss at step {step}: uninterrupted {a:.6f}, resumed {b:.6f} "
              f"(difference {abs(a - b):.1e})",
              f"transformers' logits at masked positions vs ours: max |diff| "
              f"{r['hf']['max_abs_diff']:.1e} (max |logit| {r['hf']['max_abs_logit']:.1f}); "
              f"encoder parameters {r['hf']['encoder_parameters']:,} "
              f"(expected {r['encoder_expected']:,})"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
