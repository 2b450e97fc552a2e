"""train.py on a GPU, checked against itself: resume after SIGTERM, and TP and PP against one
process, with the configuration users run (bf16, accumulation).

    python -m bench.gpu_train_checks [--steps 20] [--signal-at 10] [--work DIR] [--workers 1]

1. One GPU, NCCL (world size 1): configs/tiny.yaml in bf16, 4
   micro-batches per step, `--steps` steps; then the same run stopped by SIGTERM after step
   `--signal-at` and resumed: the losses must equal the uninterrupted run's.
2. tp = 2 and pp = 2 on two processes against the one-process run: losses within bf16
   tolerance. With two GPUs on NCCL. With one GPU, tp = 2 on two processes sharing it (gloo
   over CUDA tensors: NCCL refuses two ranks on one GPU), and pp = 2 is skipped: gloo's
   send/recv take CPU tensors only (an H200 run aborted in gloo's writev), so train.py refuses
   gloo pipelines on GPUs.
Each comparison is printed; the exit code is 1 if one fails. Without CUDA the same runs go to
the CPU with gloo, which is how CI checks this script. Needs DeepSpeed, SentencePiece, pyarrow.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The smallest run, on CPU with gloo (tests/bench/test_gpu_train_checks.py checks its lines).
TINY_ARGS = ["--steps", "8", "--signal-at", "2", "--workers", "0", "--work", "{tmp}"]

# Resumed runs repeat the same arithmetic; on a GPU some kernels (attention backward) may add
# in another order from run to run. Layouts reorder bf16 sums (tests: <= 3e-4 on CPU).
RESUME_REL, LAYOUT_REL = 1e-4, 2e-3


def make_dataset(work: Path) -> tuple[Path, Path]:
    from megatron_rembert.prep.demo_corpus import make_demo_corpus
    from megatron_rembert.prep.preprocess import PreprocessConfig, preprocess
    from megatron_rembert.prep.tokenizer import train_tokenizer

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
    start = time.monotonic()  # train.py's folder, the root, is on its module path
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    if signal_after is not None:
        while proc.poll() is None and max(losses(out / "logs"), default=0) < signal_after:
            time.sleep(0.02)
        if proc.poll() is None:
            _signal_ranks(proc.pid)
    output, _ = proc.communicate()
    if proc.returncode != 0:
        log = work / f"{name}.log"
        log.write_text(output)
        print(failure_summary(output))
        raise SystemExit(f"{name}: train.py exited with {proc.returncode} (whole output: {log})")
    print(f"  {name}: {time.monotonic() - start:.0f} s")
    return losses(out / "logs")


def failure_summary(output: str, lines: int = 25) -> str:
    """The end of each rank's lines ("[rankN]:" prefixes), then of the launcher's: the rank
    that failed first is often not the one whose traceback ends the output."""
    ranks: dict[str, list[str]] = {}
    for line in output.splitlines():
        key = line.split("]:", 1)[0][1:] if line.startswith("[rank") and "]:" in line else ""
        ranks.setdefault(key, []).append(line)
    return "\n".join(f"--- {key or 'launcher'}:\n" + "\n".join(got[-lines:])
                     for key, got in sorted(ranks.items()))


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--signal-at", type=int, default=10)
    parser.add_argument("--work", type=Path, help="working folder (default: a temporary one)")
    parser.add_argument("--workers", type=int, default=1, help="data loader processes per rank")
    parser.add_argument("--layouts-only", action="store_true",
                        help="skip the SIGTERM and resume runs (only tp = 2 and pp = 2)")
    args = parser.parse_args(argv)
    if not 0 < args.signal_at < args.steps:
        parser.error("--signal-at must be between 0 and --steps")
    import torch

    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_train_checks_"))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA)"
    print(f"train.py checks on {device}, torch {torch.__version__}; work folder {work}")
    data, tokenizer = make_dataset(work)
    sets = {"data.path": data, "data.tokenizer": tokenizer, "data.seq_length": 64,
            "data.num_workers": args.workers, "train.precision": "bf16",
            "train.steps": args.steps, "train.global_batch_size": 16,
            "train.micro_batch_size": 4, "train.log_interval": 1, "train.eval_interval": 0,
            "train.save_interval": 0, "optim.warmup_steps": 2, "parallel.timeout_minutes": 5}
    straight = train("one-process", work, 1, sets)
    results = []
    if not args.layouts_only:
        stopped = train("signalled", work, 1, sets, signal_after=args.signal_at)
        saved = (work / "signalled" / "ckpt" / "latest").read_text().strip()
        resumed = train("resumed", work, 1, sets)
        stopped_early = len(stopped) < args.steps and saved == f"step_{max(stopped):08d}"
        print(f"{'PASS' if stopped_early else 'FAIL'} the signalled run stopped early at step "
              f"{max(stopped, default=0)} of {args.steps} and saved it ({saved})"
              + ("" if stopped_early else "; if it ran to the end, the signal came too late: "
                 "more --steps after --signal-at"))
        results += [stopped_early,
                    compare(f"SIGTERM after step {args.signal_at}, saved {saved}, resumed",
                            resumed, straight, RESUME_REL)]
    gpus = torch.cuda.device_count()
    # Two GPUs take NCCL, as users run; two ranks on one GPU need gloo (NCCL refuses them),
    # and so do CPUs.
    backend = "nccl" if gpus >= 2 else "gloo"
    layouts = ["tp", "pp"]
    if gpus == 1:  # gloo cannot send CUDA tensors between stages (train.py refuses it)
        print("SKIP pp=2: one GPU; two pipeline ranks need NCCL and two GPUs")
        layouts.remove("pp")
    for name in layouts:
        try:  # a failed layout still lets the other one run
            got = train(f"{name}2-{backend}", work, 2,
                        {**sets, f"parallel.{name}": 2, "parallel.backend": backend})
        except SystemExit as failure:
            print(failure)
            got = {}
        results.append(compare(f"{name}=2 (2 processes, {backend}) vs 1 process", got,
                               straight, LAYOUT_REL))
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
