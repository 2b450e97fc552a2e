"""The console line (elapsed time, ETA, tokens/s); the run's config in TensorBoard; optional
Weights & Biases."""

import sys
import types
from pathlib import Path

import pytest

from megatron_rembert.training.metrics import (
    MetricsLogger,
    StepClock,
    format_duration,
    format_line,
)

ROOT = Path(__file__).resolve().parents[2]
VALUES = {"loss": 2.5, "mlm_acc": 0.25, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": None,
          "tokens_per_s": 12345.6, "memory": 1.5}


def test_console_line_has_elapsed_eta_and_tokens_per_second():
    t = [1000.0]
    clock = StepClock(start_step=100, total_steps=1100, now=lambda: t[0])
    t[0] += 60.0  # 10 steps after a resume at step 100, warm-up included: 6 s per step
    line = format_line(110, 1100, VALUES, *clock.times(110))
    assert "12,346 tok/s" in line and "elapsed 0:01:00" in line
    assert "eta 1:39:00" in line  # 990 steps x 6 s
    t[0] += 20.0  # the next 10 steps at 2 s each: the ETA forgets the warm-up
    line = format_line(120, 1100, VALUES, *clock.times(120))
    assert "elapsed 0:01:20" in line and "eta 0:32:40" in line  # 980 x 2 s


def test_format_duration_counts_hours_past_a_day():
    assert format_duration(0.4) == "0:00:00"
    assert format_duration(3 * 86400 + 61) == "72:01:01"


class _FakeRun:
    def __init__(self, **kwargs):
        self.init, self.logged, self.finished = kwargs, [], False

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


class _FakeWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.runs = []

    def init(self, **kwargs):
        self.runs.append(_FakeRun(**kwargs))
        return self.runs[-1]


RUN_CONFIG = {"train": {"steps": 40, "save_dir": "2024"}, "optim": {"lr": 0.001}}


def test_run_config_in_tensorboard_and_no_wandb_import_unless_set(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setitem(sys.modules, "wandb", None)  # any `import wandb` would raise
    log = MetricsLogger(tmp_path, enabled=True, run_config=RUN_CONFIG)
    log.log(1, {"loss": 2.0})
    log.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0}).Reload()
    [text] = events.Tensors("config/text_summary")
    assert "save_dir: '2024'" in text.tensor_proto.string_val[0].decode()


def test_wandb_gets_config_and_metrics_and_resumes_the_same_run(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for step in (5, 10):  # a second logger on the same log_dir: a resumed run
        log = MetricsLogger(tmp_path, enabled=True, run_config=RUN_CONFIG, wandb_project="p")
        log.log(step, {"loss": 2.0, "mlm_acc": 0.5, "note": "text"}, prefix="valid")
        log.close()
    first, second = fake.runs
    assert first.init["project"] == "p" and first.init["config"] == RUN_CONFIG
    assert first.init["id"] == second.init["id"] == (tmp_path / "wandb_run_id").read_text().strip()
    assert second.init["resume"] == "allow"
    assert first.logged == [(5, {"valid/loss": 2.0, "valid/mlm_acc": 0.5})]
    assert first.finished and second.finished
    assert not MetricsLogger(tmp_path, enabled=False, wandb_project="p").wandb_run


def test_wandb_offline_run_written_into_log_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLogger(tmp_path, enabled=True, run_config=RUN_CONFIG, wandb_project="p")
    log.log(1, {"loss": 2.0})
    log.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_wandb_project_without_wandb_is_refused_before_start(monkeypatch, capsys):
    from megatron_rembert import train

    monkeypatch.setitem(sys.modules, "wandb", None)
    code = train.main(["--config", str(ROOT / "configs/tiny.yaml"), "--dry-run",
                       "--set", "train.wandb_project=myproject"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: train.wandb_project=myproject: wandb is not")
