"""Rank-0 metrics: TensorBoard events, metrics.jsonl (one object per logged step), console."""

from __future__ import annotations

import json
import resource
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_rembert.fs import write_errors

# Dense bf16 peak FLOP/s per GPU (vendor data sheets, without sparsity).
PEAK_BF16_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12}


def peak_flops(device: torch.device) -> float | None:
    """The GPU's bf16 peak, or None on CPU or an unknown GPU (then MFU is left out)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory, or the process's peak resident memory on CPU (GiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


class MetricsLogger:
    """Writes on global rank 0 only; other ranks get a logger that does nothing.

    `run_config` (the run's settings) goes to TensorBoard as text and to W&B as its config.
    `wandb_project`: also log to that Weights & Biases project (wandb is imported only then);
    the run id is kept in log_dir/wandb_run_id, so a resumed run continues the same W&B run."""

    def __init__(self, log_dir: str | Path, enabled: bool, run_config: dict | None = None,
                 wandb_project: str = ""):
        self.enabled = enabled
        self.writer = None
        self.jsonl = None
        self.wandb_run = None
        if enabled:
            log_dir = Path(log_dir)
            from torch.utils.tensorboard import SummaryWriter

            with write_errors(log_dir / "metrics.jsonl"):
                log_dir.mkdir(parents=True, exist_ok=True)
                self.writer = SummaryWriter(str(log_dir))
                self.jsonl = open(log_dir / "metrics.jsonl", "a")  # noqa: SIM115 - in close
            if run_config is not None:
                # Indented: TensorBoard renders text as Markdown, and this keeps it verbatim.
                import yaml  # here: the GPU bench imports this module without PyYAML

                text = yaml.safe_dump(run_config, sort_keys=False)
                self.writer.add_text("config", "    " + text.replace("\n", "\n    "))
            if wandb_project:
                self.wandb_run = _start_wandb(wandb_project, log_dir, run_config)

    def log(self, step: int, values: dict, prefix: str = "train") -> None:
        """One metrics.jsonl row {"split": prefix, "step": step, **values}; each number also
        as the scalar `prefix/key`; those of values["languages"][lang] as `prefix/lang/key`
        (the per-language validation: `valid/<lang>/loss`)."""
        if not self.enabled:
            return
        scalars = _scalars(prefix, values)
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)
        with write_errors(self.jsonl.name):  # a full disk: one line naming the file
            self.jsonl.write(json.dumps({"split": prefix, "step": step, **values}) + "\n")
            self.jsonl.flush()
        with write_errors(self.writer.get_logdir()):  # TensorBoard's events file
            self.writer.flush()

    def console(self, text: str) -> None:
        if self.enabled:
            print(text, file=sys.stdout, flush=True)

    def close(self) -> None:
        if self.enabled:
            with write_errors(self.writer.get_logdir()):
                self.writer.close()
            with write_errors(self.jsonl.name):
                self.jsonl.close()
            if self.wandb_run is not None:
                self.wandb_run.finish()


def _scalars(prefix: str, values: dict) -> dict[str, float]:
    out = {}
    for key, value in values.items():
        if key == "languages" and isinstance(value, dict):
            for lang, numbers in value.items():
                out.update(_scalars(f"{prefix}/{lang}", numbers))
        elif isinstance(value, (int, float)) and key != "step":
            out[f"{prefix}/{key}"] = value
    return out


def _start_wandb(project: str, log_dir: Path, run_config: dict | None):
    import wandb

    id_file = log_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id + "\n")
    return wandb.init(project=project, id=run_id, resume="allow", dir=str(log_dir),
                      config=run_config)


def format_duration(seconds: float) -> str:
    """h:mm:ss (hours unbounded: a month-long run shows 720:00:00)."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class StepClock:
    """Elapsed wall time of this run (since `started`, a time of `now`: the process's start in
    the trainer, start-up included; default: now) and the ETA of the last step. The ETA uses
    the mean step time since the first logged step: the steps before it include the warm-up
    (the first batches, compilation, DeepSpeed's first step)."""

    def __init__(self, start_step: int, total_steps: int,
                 now: Callable[[], float] = time.monotonic, started: float | None = None):
        self.total, self.now = total_steps, now
        self.start = (start_step, now())
        self.started = self.start[1] if started is None else started
        self.first_logged: tuple[int, float] | None = None

    def times(self, step: int) -> tuple[float, float]:
        """(elapsed seconds, ETA seconds) at `step`."""
        t = self.now()
        ref_step, ref_t = self.first_logged or self.start
        if self.first_logged is None:
            self.first_logged = (step, t)
        per_step = (t - ref_t) / max(1, step - ref_step)
        return t - self.started, per_step * max(0, self.total - step)


class RunAverage:
    """Throughput over the run so far: tokens and model FLOPs per second of step time, the
    first step of this process left out (its warm-up: the first batches, allocator growth,
    DeepSpeed's first step, kernel compilation), so a short run is not dominated by it."""

    def __init__(self, world_size: int, peak: float | None):
        self.world_size, self.peak = world_size, peak
        self.steps = self.skipped = 0
        self.tokens = self.flops = self.seconds = 0.0
        self.first_step: int | None = None

    def add(self, step: int, tokens: float, flops: float, seconds: float) -> None:
        """Step `step` processed `tokens` tokens and `flops` model FLOPs in `seconds`."""
        if not self.skipped:
            self.skipped = 1
            return
        self.first_step = step if self.first_step is None else self.first_step
        self.steps += 1
        self.tokens, self.flops, self.seconds = (self.tokens + tokens, self.flops + flops,
                                                  self.seconds + seconds)

    def values(self) -> dict:
        """{"steps", "tokens_per_s", "tflops_per_gpu"[, "mfu"]}; {} before a second step."""
        if not self.steps:
            return {}
        out = {"steps": self.steps, "first_step": self.first_step,
               "tokens_per_s": self.tokens / self.seconds,
               "tflops_per_gpu": self.flops / self.seconds / self.world_size / 1e12}
        if self.peak is not None:
            out["mfu"] = out["tflops_per_gpu"] * 1e12 / self.peak
        return out

    def line(self) -> str:
        """The end-of-run console line."""
        v = self.values()
        if not v:
            return "run average: needs two steps or more (the first is the warm-up)"
        mfu = f" mfu {v['mfu']:.1%}" if "mfu" in v else ""
        return (f"run average over steps {v['first_step']}-{v['first_step'] + v['steps'] - 1}"
                f" (the first step, the warm-up, left out): {v['tokens_per_s']:,.0f} tok/s | "
                f"{v['tflops_per_gpu']:.3g} TFLOP/s/GPU{mfu}")


def format_line(step: int, total: int, v: dict, elapsed_s: float | None = None,
                eta_s: float | None = None, limit_s: float | None = None) -> str:
    """The console line of a logged step; `eta_s` is to train.steps, `limit_s` the time left
    before train.max_minutes stops the run (where set), which a resumed run continues."""
    parts = [f"step {step:>7}/{total}", f"loss {v['loss']:.4f}", f"acc {v['mlm_acc']:.3f}",
             f"lr {v['lr']:.3e}"]
    if v.get("grad_norm") is not None:
        parts.append(f"gnorm {v['grad_norm']:.3f}")
    if v.get("loss_scale") is not None:
        parts.append(f"scale {v['loss_scale']:.0f}")
    parts.append(f"{v['tokens_per_s']:,.0f} tok/s")
    if v.get("mfu") is not None:
        parts.append(f"{v['tflops_per_gpu']:.1f} TFLOP/s/GPU mfu {v['mfu']:.1%}")
    parts.append(f"mem {v['memory']:.2f} GiB")
    if elapsed_s is not None:
        parts.append(f"elapsed {format_duration(elapsed_s)}")
    if eta_s is not None:
        parts.append(f"eta {format_duration(eta_s)}")
    if limit_s is not None:
        parts.append(f"time limit in {format_duration(max(0.0, limit_s))}")
    return " | ".join(parts)
