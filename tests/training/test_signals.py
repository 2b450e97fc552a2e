"""Stop signals through train.py's main(): Ctrl-C saves like SIGTERM, a second Ctrl-C exits
at once, repeated signals during the save keep the exit clean, a signal during start-up exits
with nothing to save. Each run is a real process, since a signal handler is process-wide."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.training.conftest import SEQ

pytestmark = pytest.mark.multiprocess  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]

# Runs train.py's main() with faults injected: `signals_at_step` are sent to this process
# after step N's update, `signals_in_save` when a checkpoint save starts, `signals_at_build`
# while the model is built.
DRIVER = """
import os, signal, sys
from megatron_rembert import train
from megatron_rembert.training import engine, loop, signals

plan = {plan!r}
signals.SAME_PRESS_S = plan.get("same_press_s", signals.SAME_PRESS_S)

def send(names):
    for name in names:
        os.kill(os.getpid(), getattr(signal, name))

real_step, real_save, real_init = (engine.Trainer.train_step, loop.ckpt.save_checkpoint,
                                   engine.Trainer.__init__)
calls = {{"step": 0}}

def step(self, batches):
    stats = real_step(self, batches)
    calls["step"] += 1
    if calls["step"] == plan.get("at_step"):
        send(plan["signals_at_step"])
    return stats

def save(*args, **kwargs):
    send(plan.get("signals_in_save", []))
    return real_save(*args, **kwargs)

def init(self, *args, **kwargs):
    send(plan.get("signals_at_build", []))
    real_init(self, *args, **kwargs)

engine.Trainer.train_step, loop.ckpt.save_checkpoint, engine.Trainer.__init__ = step, save, init
train.console_main(sys.argv[1:])  # as rembert-train ends
"""


def _run(tmp: Path, tiny_dataset, plan: dict, **sets) -> subprocess.CompletedProcess:
    data, tokenizer = tiny_dataset
    values = {"data.path": data, "data.tokenizer": tokenizer, "data.seq_length": SEQ,
              "data.num_workers": 1, "train.steps": 4, "train.global_batch_size": 4,
              "train.micro_batch_size": 2, "train.eval_interval": 0, "train.save_interval": 0,
              "train.precision": "fp32",
              "train.save_dir": tmp / "ckpt", "train.log_dir": tmp / "logs", **sets}
    args = ["--config", "configs/tiny.yaml"]
    for key, value in values.items():
        args += ["--set", f"{key}={value}"]
    run = subprocess.run([sys.executable, "-c", DRIVER.format(plan=plan), *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "Traceback" not in run.stderr and "KeyboardInterrupt" not in run.stderr, run.stderr
    return run


def _latest(tmp: Path) -> str:
    return (tmp / "ckpt" / "latest").read_text().strip()


def test_ctrl_c_saves_and_repeated_signals_during_the_save_exit_0(tmp_path, tiny_dataset):
    # Ctrl-C twice within SAME_PRESS_S (the terminal's and torchrun's copy), then SIGTERM and
    # SIGUSR1 twice while the checkpoint is written: one clean save, exit 0.
    plan = {"at_step": 2, "signals_at_step": ["SIGINT", "SIGINT"],
            "signals_in_save": ["SIGTERM", "SIGUSR1", "SIGTERM", "SIGUSR1"]}
    run = _run(tmp_path, tiny_dataset, plan)
    assert run.returncode == 0, run.stderr
    assert "saved step 2" in run.stdout
    assert _latest(tmp_path) == "step_00000002"
    assert (tmp_path / "ckpt" / "step_00000002" / "complete").exists()


def test_second_ctrl_c_exits_at_once_keeping_the_last_checkpoint(tmp_path, tiny_dataset):
    # Saved every step; Ctrl-C after step 2, pressed again while step 2 is being saved.
    plan = {"at_step": 2, "signals_at_step": ["SIGINT"], "signals_in_save": ["SIGINT"],
            "same_press_s": -1.0}
    run = _run(tmp_path, tiny_dataset, plan, **{"train.save_interval": 1})
    assert run.returncode == 130, run.stderr
    assert "second Ctrl-C: exiting now" in run.stderr
    assert _latest(tmp_path) == "step_00000001"
    assert not (tmp_path / "ckpt" / "step_00000002").exists()


def test_signal_during_start_up_exits_0_with_nothing_to_save(tmp_path, tiny_dataset):
    run = _run(tmp_path, tiny_dataset, {"signals_at_build": ["SIGUSR1"]})
    assert run.returncode == 0, run.stderr
    assert "SIGUSR1 during start-up: nothing new to save" in run.stdout
    assert not (tmp_path / "ckpt" / "latest").exists()


# The stop flag alone (no torch): `sent` in turn to this process; `settle` is the run's last
# save done; `teardown` makes an object that sends SIGTERM while the interpreter is torn down
# (a module global's __del__), after Python has put back the default action of every signal
# with a Python handler: where a signal repeated every 100 ms lands as a rank exits.
FLAG_DRIVER = """
import os, signal, sys
from megatron_rembert.training import signals

signals.SAME_PRESS_S = -1.0  # any Ctrl-C after the first is a second press
flag = signals.StopFlag()


class SignalAtTeardown:
    def __del__(self, kill=os.kill, pid=os.getpid(), sig=signal.SIGTERM):
        kill(pid, sig)


for name in sys.argv[1:]:
    if name == "settle":
        flag.settle()
    elif name == "teardown":
        at_teardown = SignalAtTeardown()
    else:
        os.kill(os.getpid(), getattr(signal, name))
print(flag.name, flag.raised, flush=True)
"""

FLAG_CASES = [
    # The first request was SIGTERM: Ctrl-Cs after it change nothing (save, exit 0).
    ("sigterm-then-ctrl-c", ["SIGTERM", "SIGINT", "SIGINT", "SIGUSR1"], 0, "SIGTERM True"),
    ("second-ctrl-c", ["SIGINT", "SIGINT"], 130, ""),
    # Python's own teardown: without settle() a signal then kills the process (143 in a shell).
    ("teardown-unsettled", ["SIGTERM", "teardown"], -signal.SIGTERM, "SIGTERM True"),
    # Once settled nothing changes, a second Ctrl-C and the teardown's signal included.
    ("settled", ["SIGINT", "settle", "SIGINT", "SIGTERM", "SIGUSR1", "teardown"], 0,
     "SIGINT True"),
]


@pytest.mark.parametrize("case", FLAG_CASES, ids=[c[0] for c in FLAG_CASES])
def test_the_job_exits_as_the_first_signal_asked(case):
    _, sent, code, said = case
    run = subprocess.run([sys.executable, "-c", FLAG_DRIVER, *sent], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == code, run.stdout + run.stderr
    assert run.stdout.strip() == said, run.stdout + run.stderr
