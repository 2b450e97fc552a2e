"""A stop is a clean exit under torchrun (issue 30): after the stop save every rank exits 0
within seconds, whoever got the signal, and the resumed run equals an uninterrupted one; a
signal at any moment of start-up ends every rank with exit 0, nothing saved, no traceback.

Real `torchrun --nproc_per_node 2` runs of configs/tiny.yaml (gloo, a loader worker per rank,
as configs/tiny.yaml has it). The signals go where a user or a scheduler sends them:
- `torchrun`: torchrun's process group (Ctrl-C in a terminal; `kill -- -PGID`). torchrun
  runs every rank in a session of its own, so only torchrun gets it and passes it on.
- `ranks`: every rank's process group (the rank and its loader worker), not torchrun: what
  slurm/pretrain.sbatch does.
- `every process`: both at once, what a scheduler does when it ends or preempts a job step.
torchrun ends with exit 1 and a traceback of its own when it was signalled itself (torch's
SignalException) and does not report its ranks' exit codes then, so each rank runs under
`sh`, which writes the rank's exit code to a file and passes it on to torchrun.

The hang this guards against (issue 30) kept both ranks alive after their save until
torchrun's SIGKILL 30 s later; the bound below is on that hang, not a performance timing."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.training.conftest import SEQ

pytestmark = pytest.mark.multiprocess  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]
STEPS = 24
# From the signal to torchrun's exit: below torchrun's 30 s grace before its SIGKILL, which
# the hang lasted; a bound on that hang, far above a clean stop's few seconds.
HANG_BOUND_S = 25.0
STEP_LINE = re.compile(r"^step\s+(\d+)/")
# Runs the rank, keeps its stderr in a file and its exit code in another, exits with it. sh
# outlives the stop signals sent to its process group (a trap with a command is not inherited:
# the rank starts with the default handlers, as under torchrun alone).
RANK_SH = ("trap : TERM INT USR1; \"$@\" 2> \"$RANK_LOGS/stderr.$RANK\"; rc=$?; "
           "echo $rc > \"$RANK_LOGS/exit.$RANK\"; exit $rc")


def _settings(run: Path, tiny_dataset, steps: int = STEPS) -> list[str]:
    data, tokenizer = tiny_dataset
    values = {"data.path": data, "data.tokenizer": tokenizer, "data.seq_length": SEQ,
              "data.num_workers": 1, "train.steps": steps, "train.global_batch_size": 4,
              "train.micro_batch_size": 2, "train.log_interval": 1, "train.eval_interval": 0,
              "train.save_interval": 0, "train.precision": "fp32",
              "parallel.timeout_minutes": 2,  # a rank left alone fails soon, not in 10 min
              "train.save_dir": run / "ckpt", "train.log_dir": run / "logs"}
    args = ["--config", "configs/tiny.yaml"]
    for key, value in values.items():
        args += ["--set", f"{key}={value}"]
    return args


class Torchrun:
    """One torchrun run of train.py in a session of its own; stdout read line by line."""

    def __init__(self, run: Path, tiny_dataset, script: str = "train.py", steps: int = STEPS):
        self.logs = run / "rank_logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        for old in self.logs.iterdir():
            old.unlink()
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", "2", "--no-python", "sh", "-c", RANK_SH, "rank",
                   sys.executable, script, *_settings(run, tiny_dataset, steps)]
        self.process = subprocess.Popen(
            command, cwd=ROOT, env={**os.environ, "RANK_LOGS": str(self.logs)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        self.lines: list[str] = []
        self.step = 0
        self._progress = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._progress:
                self.lines.append(line)
                match = STEP_LINE.match(line)
                self.step = int(match.group(1)) if match else self.step
                self._progress.notify_all()

    def wait_for_step(self, step: int) -> None:
        with self._progress:
            done = self._progress.wait_for(
                lambda: self.step >= step or self.process.poll() is not None, timeout=600)
        assert done and self.process.poll() is None, f"no step {step}:\n{self.output}"

    def ranks(self) -> list[int]:
        """torchrun's children: the ranks (their sh), each the leader of its process group."""
        pid = self.process.pid
        children = [int(child) for task in os.listdir(f"/proc/{pid}/task")
                    for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        ranks = [child for child in children
                 if Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"sh\0-c\0trap")]
        assert len(ranks) == 2, children
        return ranks

    def groups(self, target: str) -> list[int]:
        """The process groups a signal to `target` goes to."""
        return {"torchrun": [self.process.pid], "ranks": self.ranks(),
                "every process": [self.process.pid, *self.ranks()]}[target]

    def send(self, target: str, sig: signal.Signals) -> float:
        for group in self.groups(target):
            os.killpg(group, sig)
        return time.monotonic()

    def keep_sending(self, target: str, signals: list[signal.Signals], every_s: float,
                     timeout_s: float = 120.0) -> int:
        """Sends `signals` in turn to `target` every `every_s` seconds until torchrun and
        every rank have exited (a rank may outlive a signalled torchrun); returns how many
        were sent. Process groups that are gone are skipped."""
        groups = self.groups(target)
        sent, end = 0, time.monotonic() + timeout_s
        while (self.process.poll() is None or len(self.rank_exits()) < 2) and \
                time.monotonic() < end:
            time.sleep(every_s)
            for group in groups:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signals[sent % len(signals)])
            sent += 1
        return sent

    def wait(self) -> float:
        self.process.wait(timeout=600)
        self._reader.join(timeout=60)
        return time.monotonic()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def rank_exits(self) -> dict[int, int]:
        return {rank: int((self.logs / f"exit.{rank}").read_text())
                for rank in (0, 1) if (self.logs / f"exit.{rank}").exists()}

    def rank_errors(self) -> str:
        return "".join(p.read_text() for p in sorted(self.logs.glob("stderr.*")))


def _losses(run: Path) -> dict[int, float]:
    rows = map(json.loads, (run / "logs" / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


def _latest_step(run: Path) -> int:
    latest = run / "ckpt" / "latest"
    return int(latest.read_text().strip().split("_")[1]) if latest.exists() else 0


def test_stops_end_every_rank_at_once_and_resume_exactly(tmp_path, tiny_dataset):
    reference = Torchrun(tmp_path / "reference", tiny_dataset)
    reference.wait()
    assert reference.process.returncode == 0, reference.output
    uninterrupted = _losses(tmp_path / "reference")
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))

    # SIGTERM to every process three times, each at another moment of the run (after 1, 2
    # and 3 steps since the resume), then SIGUSR1 to the ranks and Ctrl-C to torchrun.
    run, saved = tmp_path / "stopped", 0
    for target, sig, steps in (("every process", signal.SIGTERM, 1),
                               ("every process", signal.SIGTERM, 2),
                               ("every process", signal.SIGTERM, 3),
                               ("ranks", signal.SIGUSR1, 2), ("torchrun", signal.SIGINT, 2)):
        torchrun = Torchrun(run, tiny_dataset)
        torchrun.wait_for_step(saved + steps)
        sent = torchrun.send(target, sig)
        took = torchrun.wait() - sent
        print(f"{sig.name} to {target}: torchrun exited {took:.1f} s after the signal")
        what = f"{sig.name} to {target}:\n{torchrun.output}\n{torchrun.rank_errors()}"
        assert torchrun.rank_exits() == {0: 0, 1: 0}, what
        assert "forcefully exiting" not in torchrun.output, what
        assert "Traceback" not in torchrun.rank_errors(), what
        if target == "ranks":  # torchrun itself was not signalled: it reports the ranks
            assert torchrun.process.returncode == 0, what
        assert took < HANG_BOUND_S, f"{took:.1f} s from the signal to the exit; {what}"
        assert _latest_step(run) > saved, what
        saved = _latest_step(run)
        assert f"signal received ({sig.name}): saved step {saved}" in torchrun.output, what
    assert saved < STEPS
    final = Torchrun(run, tiny_dataset)
    final.wait()
    assert final.process.returncode == 0, final.output
    resumed = _losses(run)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step, loss in uninterrupted.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-6), f"step {step}"


# Runs train.py's main() in each rank with a signal sent to the rank itself at one moment of
# start-up, to the ranks of the plan only (the others learn it from the ranks' agreement).
STARTUP_DRIVER = """
import importlib.abc, importlib.machinery, os, signal, sys
plan = {plan!r}

def send():
    if int(os.environ["RANK"]) in plan["ranks"]:
        os.kill(os.getpid(), getattr(signal, plan["signal"]))

class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == plan.get("during_import"):  # part of the way into its package's import
            plan.pop("during_import")
            send()
        if name == "megatron_rembert.training.engine" and plan["at"] == "model build":
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            real_exec = spec.loader.exec_module

            def exec_module(module):
                real_exec(module)
                real_init = module.Trainer.__init__

                def init(self, *args, **kwargs):
                    send()
                    real_init(self, *args, **kwargs)

                module.Trainer.__init__ = init

            spec.loader.exec_module = exec_module
            return spec
        return None

sys.meta_path.insert(0, Hook())
from megatron_rembert.training import signals

if plan["at"] == "first line":
    real_install = signals.StopFlag.__init__

    def install(self):
        real_install(self)
        send()

    signals.StopFlag.__init__ = install
from megatron_rembert import train

if __name__ == "__main__":  # not in the loader's spawned workers, which import this file
    train.console_main(sys.argv[1:])  # as rembert-train ends
"""

STARTUP_POINTS = [
    {"at": "first line", "ranks": [0, 1], "signal": "SIGTERM"},
    {"at": "import torch", "during_import": "torch.nn", "ranks": [1], "signal": "SIGINT"},
    {"at": "import deepspeed", "during_import": "deepspeed.runtime.engine", "ranks": [0, 1],
     "signal": "SIGUSR1"},
    {"at": "model build", "ranks": [0], "signal": "SIGTERM"},
]


@pytest.mark.parametrize("plan", STARTUP_POINTS, ids=[p["at"] for p in STARTUP_POINTS])
def test_a_signal_during_start_up_exits_0_with_nothing_saved(tmp_path, tiny_dataset, plan):
    driver = tmp_path / "driver.py"
    driver.write_text(STARTUP_DRIVER.format(plan=plan))  # the installed package
    torchrun = Torchrun(tmp_path, tiny_dataset, script=str(driver))
    torchrun.wait()
    what = f"{plan}:\n{torchrun.output}\n{torchrun.rank_errors()}"
    assert torchrun.process.returncode == 0 and torchrun.rank_exits() == {0: 0, 1: 0}, what
    told = plan["signal"] if 0 in plan["ranks"] else "a signal to another rank"
    assert f"{told} during start-up: nothing new to save" in torchrun.output, what
    assert "Traceback" not in torchrun.output + torchrun.rank_errors(), what
    assert torchrun.step == 0 and not (tmp_path / "ckpt" / "latest").exists(), what


@pytest.fixture(scope="module")
def losses_of_8_steps(tmp_path_factory, tiny_dataset) -> dict[int, float]:
    run = tmp_path_factory.mktemp("reference")
    reference = Torchrun(run, tiny_dataset, steps=8)
    reference.wait()
    assert reference.process.returncode == 0, reference.output
    return _losses(run)


@pytest.mark.parametrize("target", ["ranks", "every process"])
def test_signals_repeated_until_the_exit_change_nothing_after_the_first(
        target, tmp_path, tiny_dataset, losses_of_8_steps):
    """A scheduler or an impatient user repeating stop signals every 100 ms from the first
    SIGTERM until the job is gone: the job still exits as the first signal asked (save, exit 0
    on every rank), `latest` names the saved step and the resumed run equals an uninterrupted
    one. torchrun reports its ranks' exit codes when only they were signalled; signalled
    itself, it exits 1 (torch's SignalException on SIGTERM or SIGINT) or is ended by a
    SIGUSR1, which it does not handle (torchrun's --signals-to-handle leaves it out by
    default), or by a repeated SIGTERM / SIGINT that arrives while it handles the first,
    whatever its ranks did."""
    steps = 8
    run = tmp_path / "stopped"
    torchrun = Torchrun(run, tiny_dataset, steps=steps)
    torchrun.wait_for_step(2)
    torchrun.send(target, signal.SIGTERM)
    repeated = torchrun.keep_sending(target, [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT],
                                     every_s=0.1)
    torchrun.wait()
    what = f"{repeated} signals after the first:\n{torchrun.output}\n{torchrun.rank_errors()}"
    print(what)
    assert torchrun.rank_exits() == {0: 0, 1: 0}, what
    assert repeated >= 2, what  # the signals did go on during the save and the exit
    if target == "ranks":
        assert torchrun.process.returncode == 0, what
    else:  # torch's own: it raises on SIGTERM / SIGINT and does not handle SIGUSR1
        assert torchrun.process.returncode in (1, -signal.SIGUSR1, -signal.SIGTERM,
                                               -signal.SIGINT), what
    assert "Traceback" not in torchrun.rank_errors() and "second Ctrl-C" not in what, what
    saved = _latest_step(run)
    assert 2 <= saved < steps, what
    assert f"signal received (SIGTERM): saved step {saved}" in torchrun.output, what
    final = Torchrun(run, tiny_dataset, steps=steps)
    final.wait()
    assert final.process.returncode == 0, final.output
    resumed = _losses(run)
    assert sorted(resumed) == sorted(losses_of_8_steps) == list(range(1, steps + 1))
    for step, loss in losses_of_8_steps.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-6), f"step {step}"


def test_the_command_ends_without_the_interpreters_teardown():
    """rembert-train and train.py end with main's exit code once main has returned, with
    their output flushed and without the interpreter's teardown (where gloo's backends could
    abort a rank that had ended cleanly): an exit handler registered before never runs. A
    bug's exception still ends the usual way, teardown included."""
    code = ("import atexit, runpy, sys\n"
            "atexit.register(lambda: print('teardown ran', flush=True))\n"
            "sys.argv = ['train.py'] + sys.argv[1:]\n"
            "runpy.run_path('train.py', run_name='__main__')\n")
    dry = subprocess.run([sys.executable, "-c", code, "--config", "configs/tiny.yaml",
                          "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "teardown ran" not in dry.stdout and "parameters" in dry.stdout, dry.stdout[-2000:]
    bad = subprocess.run([sys.executable, "-c", code, "--config", "configs/tiny.yaml",
                          "--set", "train.steps=-1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "error:" in bad.stderr and "teardown ran" not in bad.stdout
    broken = code.replace("runpy.run_path", "import megatron_rembert.train as t\n"
                          "t.main = lambda argv=None: 1 / 0\nrunpy.run_path")
    crash = subprocess.run([sys.executable, "-c", broken, "--config", "configs/tiny.yaml"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert crash.returncode == 1 and "ZeroDivisionError" in crash.stderr
    assert "teardown ran" in crash.stdout
