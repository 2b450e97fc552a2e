"""train.py on a GPU, checked against itself: resume after SIGTERM, and TP and PP against one
process, with the configuration users run (bf16, ds_configs/zero1_bf16.json, accumulation).

    python bench/gpu_train_checks.py [--steps 20] [--signal-at 10] [--work DIR] [--workers 1]

1. One GPU, NCCL (world size 1): configs/tiny.yaml in bf16 with ds_configs/zero1_bf16.json, 4
   micro-batches per step, `--steps` steps; then the same run stopped by SIGTERM after step
   `--signal-at` and resumed: the losses must equal the uninterrupted run's.
2. tp = 2 and pp = 2 on two processes sharing the GPU (gloo over CUDA tensors: NCCL refuses two
   ranks on one GPU) against the one-process run: losses within bf16 tolerance.
Each comparison is printed; the exit code is 1 if one fails. Without CUDA the same runs go to
the CPU with gloo, which is how CI checks this script. Needs DeepSpeed, SentencePiece, pyarrow.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

# Resumed runs repeat the same arithmetic; on a GPU some kernels (attention backward) may add
# in another order from run to run. Layouts reorder bf16 sums (tests: <= 3e-4 on CPU).
RESUME_REL, LAYOUT_REL = 1e-4, 2e-3


def make_dataset(work: Path) -> tuple[Path, Path]:
    from megatron_rembert.data.demo_corpus import make_demo_corpus
    from megatron_rembert.data.preprocess import PreprocessConfig, preprocess
    from megatron_rembert.data.tokenizer import train_tokenizer

    data, tokenizer = work / "data", work / "tok" / "spm.model"
    if not (data / "manifest.json").exists():
        make_demo_corpus(work / "corpus", size_mb=0.3)
        train_tokenizer(work / "corpus", work / "tok" / "spm", vocab_size=1000)
        preprocess(PreprocessConfig(str(work / "corpus"), str(data), str(tokenizer),
                                    seq_length=64, workers=1, valid_fraction=0.05,
                                    progress=False))
    return data, tokenizer


def losses(log_dir: Path) -> dict[int, float]:
    path = log_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


def train(name: str, work: Path, nproc: int, sets: dict, signal_after: int | None = None,
          ) -> dict[int, float]:
    """train.py under torchrun; optionally SIGTERM to its ranks once step `signal_after` is
    logged. Returns the logged losses by step."""
    out = work / name
    args = [f"{k}={v}" for k, v in {**sets, "train.save_dir": out / "ckpt",
                                    "train.log_dir": out / "logs"}.items()]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", str(ROOT / "train.py"), "--config",
               str(ROOT / "configs" / "tiny.yaml")] + [a for x in args for a in ("--set", x)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    if signal_after is not None:
        while proc.poll() is None and max(losses(out / "logs"), default=0) < signal_after:
            time.sleep(0.02)
        if proc.poll() is None:
            _signal_ranks(proc.pid)
    output, _ = proc.communicate()
    if proc.returncode != 0:
        print(output[-4000:])
        raise SystemExit(f"{name}: train.py exited with {proc.returncode}")
    print(f"  {name}: {time.monotonic() - start:.0f} s")
    return losses(out / "logs")


def _signal_ranks(launcher_pid: int) -> None:
    """SIGTERM to the ranks (torchrun's children), as SLURM's preemption warning reaches them."""
    import psutil

    for child in psutil.Process(launcher_pid).children(recursive=False):
        child.send_signal(signal.SIGTERM)


def compare(name: str, got: dict[int, float], expected: dict[int, float], rel: float) -> bool:
    missing = sorted(set(expected) - set(got))
    worst = max((abs(got[s] - v) / abs(v) for s, v in expected.items() if s in got),
                default=float("inf"))
    ok = not missing and worst <= rel
    print(f"{'PASS' if ok else 'FAIL'} {name}: {len(expected)} steps, max relative loss "
          f"difference {worst:.1e} (tolerance {rel:.0e})"
          + (f", missing steps {missing}" if missing else ""))
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--signal-at", type=int, default=10)
    parser.add_argument("--work", type=Path, help="working folder (default: a temporary one)")
    parser.add_argument("--workers", type=int, default=1, help="data loader processes per rank")
    args = parser.parse_args()
    if not 0 < args.signal_at < args.steps:
        parser.error("--signal-at must be between 0 and --steps")
    import torch

    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_train_checks_"))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA)"
    print(f"train.py checks on {device}, torch {torch.__version__}; work folder {work}")
    data, tokenizer = make_dataset(work)
    sets = {"data.path": data, "data.tokenizer": tokenizer, "data.seq_length": 64,
            "data.num_workers": args.workers, "train.precision": "bf16",
            "parallel.ds_config": ROOT / "ds_configs" / "zero1_bf16.json",
            "train.steps": args.steps, "train.global_batch_size": 16,
            "train.micro_batch_size": 4, "train.log_interval": 1, "train.eval_interval": 0,
            "train.save_interval": 0, "optim.warmup_steps": 2, "parallel.timeout_minutes": 5}
    straight = train("one-process", work, 1, sets)
    stopped = train("signalled", work, 1, sets, signal_after=args.signal_at)
    saved = (work / "signalled" / "ckpt" / "latest").read_text().strip()
    resumed = train("resumed", work, 1, sets)
    shared = {**sets, "parallel.backend": "gloo"}
    tp2 = train("tp2-shared-gpu", work, 2, {**shared, "parallel.tp": 2})
    pp2 = train("pp2-shared-gpu", work, 2, {**shared, "parallel.pp": 2})
    results = [
        len(stopped) < args.steps and saved == f"step_{max(stopped):08d}",
        compare(f"SIGTERM after step {args.signal_at}, saved {saved}, resumed", resumed,
                straight, RESUME_REL),
        compare("tp=2 (2 processes, gloo) vs 1 process", tp2, straight, LAYOUT_REL),
        compare("pp=2 (2 processes, gloo) vs 1 process", pp2, straight, LAYOUT_REL),
    ]
    print(f"{'PASS' if results[0] else 'FAIL'} the signalled run stopped early at step "
          f"{max(stopped, default=0)} of {args.steps} and saved it ({saved})"
          + ("" if results[0] else "; if it ran to the end, the signal came too late: more "
             "--steps after --signal-at"))
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
