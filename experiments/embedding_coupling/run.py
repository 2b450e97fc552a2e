"""The paper's embedding-coupling comparison on real multilingual text, at one machine's scale.

    apt-get download $(printf 'libreoffice-help-%s ' en-us de fr es ru el ja zh-cn ko hi tr fi vi)
    python -m experiments.embedding_coupling.run --debs . --work ec_work

One resumable command: the LibreOffice help corpus (rembert-libreoffice-corpus), a tokenizer,
Arrow shards, then every variant of variants.py x seed pre-trained at equal tokens
(rembert-train, one process) and evaluated (rembert-eval: retrieval and zero-shot topic
classification, beside step 0, a bag of tokens and chance). Each finished run writes its result
file to experiments/embedding_coupling/results/<scale>/<tag>/<variant>-seed<k>.json at once;
commit those files as they appear: a rerun skips every run whose result file exists, and a run
that was interrupted resumes from its last checkpoint under --work. report.py turns the result
files into docs/experiments.md.

`--set key=value` (train.py's keys) changes the recipe for a search; give such runs their own
`--tag` so they never mix with the sweep's results.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from experiments.embedding_coupling.variants import SCALES, VARIANTS, Scale, variant_model
from megatron_rembert.model.sizes import parameter_counts

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# 13 languages in 7 scripts: Latin, Cyrillic, Greek, Devanagari, Han, Japanese, Hangul.
# Held-out pairs per language, for rembert-eval and for the trainer's retrieval while training
# (the same fixed subset at the same number), so the learning curve and the final figures agree.
EVAL_PAIRS = 1000
LANGUAGES = ("en", "de", "fr", "es", "fi", "tr", "vi", "ru", "el", "hi", "zh-cn", "ja", "ko")


def free_port() -> int:
    """A free TCP port for a one-process run's rendezvous (another job may hold 29500)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(cmd: list[str], log: Path | None = None) -> None:
    """Run one stage; its output goes to the console (and `log`); a failure ends the run."""
    print("+ " + " ".join(cmd), flush=True)
    env = {**os.environ, "MASTER_PORT": str(free_port())}
    if log is None:
        code = subprocess.call(cmd, env=env)
    else:
        with open(log, "a") as out:
            code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    if code:
        sys.exit(f"error: {cmd[0]} exited {code}" + (f" (log: {log})" if log else ""))


def prepare(args, scale: Scale, work: Path) -> dict[str, Path]:
    """Corpus, tokenizer and dataset under `work`, each skipped when it exists."""
    corpus, tok, data = work / "libreoffice", work / "tokenizer" / "spm", work / "dataset"
    if not (corpus / "summary.json").exists():
        sh(["rembert-libreoffice-corpus", "--debs", str(args.debs), "--out", str(corpus),
            "--languages", ",".join(args.languages)])
    sh(["rembert-train-tokenizer", "--corpus", str(corpus / "corpus"), "--out", str(tok),
        "--vocab-size", str(scale.vocab_size)])
    sh(["rembert-preprocess", "--corpus", str(corpus / "corpus"), "--tokenizer",
        f"{tok}.model", "--out", str(data), "--seq-length", str(scale.seq_length),
        "--valid-fraction", "0.02", "--no-progress"])
    return {"corpus": corpus, "tokenizer": Path(f"{tok}.model"), "data": data}


def train_settings(variant: str, scale: Scale, seed: int, paths: dict, run_dir: Path,
                   extra: list[str]) -> list[str]:
    """train.py --set arguments of one run: the variant's model, the scale's recipe."""
    model = variant_model(variant, scale)
    fields = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size", "input_embedding_size", "output_embedding_size",
              "max_position_embeddings", "tie_embeddings")
    sets = [f"model.{f}={getattr(model, f)}" for f in fields]
    sets += [f"data.path={paths['data']}", f"data.tokenizer={paths['tokenizer']}",
             f"data.seq_length={scale.seq_length}", "data.num_workers=1",
             f"parallel.ds_config={scale.ds_config}", "parallel.zero_stage=1",
             f"optim.lr={scale.lr}", f"optim.warmup_steps={scale.warmup_steps}",
             "optim.weight_decay=0.01", f"train.steps={scale.steps}",
             f"train.global_batch_size={scale.global_batch_size}",
             f"train.micro_batch_size={scale.micro_batch_size}",
             f"train.precision={scale.precision}", f"train.seed={seed}",
             # validation and retrieval at a quarter of the run each: retrieval over EVAL_PAIRS x 12
             # languages costs about 2 minutes on 2 cores, as much as 250 training steps
             "train.log_interval=50", f"train.eval_interval={max(scale.steps // 4, 1)}",
             "train.eval_batches=4", f"train.save_interval={max(scale.steps // 10, 1)}",
             "train.keep_last=1", f"train.save_dir={run_dir / 'checkpoints'}",
             f"train.log_dir={run_dir / 'logs'}",
             # retrieval on held-out pairs at every validation: the transfer learning curve
             f"eval.retrieval_path={paths['corpus'] / 'eval' / 'parallel'}",
             f"eval.retrieval_pairs={EVAL_PAIRS}"]
    return [arg for s in sets + extra for arg in ("--set", s)]


def read_metrics(log_dir: Path) -> dict:
    """The learning curve and the last validation row of a finished run's metrics.jsonl."""
    rows = [json.loads(line) for line in open(log_dir / "metrics.jsonl")]
    train = [r for r in rows if r.get("split") == "train"]
    valid = [r for r in rows if r.get("split") == "valid"]
    return {"train_curve": [[r["step"], r["loss"]] for r in train],
            # middle layer, eval.retrieval_pairs pairs per language: [step, to_en, from_en]
            "retrieval_curve": [[r["step"], r["retrieval_to_en"], r["retrieval_from_en"]]
                                for r in valid if "retrieval_to_en" in r],
            "consumed_samples": train[-1]["consumed_samples"] if train else 0,
            "valid_curve": [[r["step"], r["loss"]] for r in valid],
            "valid": valid[-1] if valid else None}


def one_run(args, scale: Scale, paths: dict, variant: str, seed: int) -> None:
    out = HERE / "results" / args.scale / args.tag / f"{variant}-seed{seed}.json"
    if out.exists():
        print(f"{variant} seed {seed}: already done ({out.relative_to(ROOT)})")
        return
    run_dir = args.work / "runs" / args.scale / args.tag / f"{variant}-seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    commit = _commit()  # the code that trains, not whatever is checked out when it ends
    start = time.time()
    sh(["rembert-train", "--config", str(ROOT / "configs" / "tiny.yaml"),
        *train_settings(variant, scale, seed, paths, run_dir, args.set)], run_dir / "train.log")
    trained_s = time.time() - start
    ev = paths["corpus"] / "eval"
    common = ["rembert-eval", "--checkpoint", str(run_dir / "checkpoints"), "--parallel",
              str(ev / "parallel"), "--max-pairs", str(EVAL_PAIRS), "--layer", "all", "--quiet"]
    # As XTREME: the raw cosine; and each language's mean vector removed (--center), which
    # separates what the encoder aligns from the direction every text of a language shares.
    sh([*common, "--classify-train", str(ev / "topic" / "train.jsonl"), "--classify-test",
        str(ev / "topic" / "test.jsonl"), "--seeds", str(args.eval_seeds),
        "--out", str(run_dir / "eval.json")], run_dir / "eval.log")
    sh([*common, "--skip-classify", "--center", "--out", str(run_dir / "eval_centered.json")],
       run_dir / "eval.log")
    model = variant_model(variant, scale)
    counts = parameter_counts(model)
    metrics = read_metrics(run_dir / "logs")
    result = {
        "variant": variant, "seed": seed, "scale": args.scale, "tag": args.tag,
        "settings": args.set, "commit": commit, "scale_settings": asdict(scale),
        "model": asdict(model),
        "parameters": {"pretraining": counts.pretraining, "finetuning": counts.finetuning},
        # what was trained (a --set may change the steps or the batch), not the scale's plan
        "tokens": metrics["consumed_samples"] * scale.seq_length,
        "retrieval_curve_pairs": EVAL_PAIRS,
        "train_seconds": round(trained_s), "eval_seconds": round(time.time() - start
                                                                 - trained_s),
        "metrics": metrics,
        "eval": json.loads((run_dir / "eval.json").read_text()),
        "eval_centered": json.loads((run_dir / "eval_centered.json").read_text()),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    print(f"{variant} seed {seed}: wrote {out.relative_to(ROOT)} (commit it)", flush=True)


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debs", type=Path, required=True,
                   help="folder of libreoffice-help-<lang>_*.deb files")
    p.add_argument("--work", type=Path, required=True,
                   help="corpus, dataset, checkpoints and logs (large; not committed)")
    p.add_argument("--scale", choices=sorted(SCALES), default="cpu-small",
                   help="cpu-small: the setup the search found to learn transfer (the sweep's); "
                        "cpu: twice as wide, one epoch; gpu: mBERT-base width")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--seeds", type=int, default=2, help="pre-training seeds per variant")
    p.add_argument("--eval-seeds", type=int, default=3, help="fine-tuning seeds per model")
    p.add_argument("--languages", type=lambda s: s.split(","), default=list(LANGUAGES))
    p.add_argument("--tag", default="sweep", help="results subfolder (a search: its own tag)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra train.py setting for every run of this tag")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            sys.exit(f"error: --variants: unknown variant {v!r}; one of {', '.join(VARIANTS)}")
    scale = SCALES[args.scale]
    paths = prepare(args, scale, args.work.resolve())
    for seed in range(1, args.seeds + 1):  # seed-major: every variant has a seed early
        for variant in variants:
            one_run(args, scale, paths, variant, seed)


if __name__ == "__main__":
    main()
