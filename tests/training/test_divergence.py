"""Divergence is a stop, not a success (training/divergence.py): the per-step rule and the
good-checkpoint rule against plain numbers, then real runs that diverge (a huge learning rate,
weights blown up finite, a loss jump), each ending with exit 2, exactly one `error:` line per
rank naming the step `latest` keeps, no traceback, `latest` never past the last good step and
nothing outside the run's folders changed."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rembert.config import ConfigError
from megatron_rembert.run_config.checks import check_ranges
from megatron_rembert.run_config.load import load_config
from megatron_rembert.training.divergence import (
    DivergenceCheck,
    DivergenceError,
    check_weights,
    weights_max_abs,
)
from tests.training.conftest import SEQ

ROOT = Path(__file__).resolve().parents[2]
NAN, INF = float("nan"), float("inf")


# -- the per-step rule ----------------------------------------------------------------------
def _feed(check: DivergenceCheck, steps: list[tuple], start: int = 0) -> list[str | None]:
    """`problem` for each (loss, grad_norm_finite, skipped[, last_step]), numbered from
    `start + 1`."""
    return [check.problem(start + i, *s) for i, s in enumerate(steps, 1)]


def test_an_applied_step_with_a_non_finite_loss_or_norm_stops_at_once():
    for loss, norm_finite in ((NAN, True), (INF, True), (-INF, False), (5.0, False)):
        check = DivergenceCheck(factor=0.0, window=3, max_not_applied=10)
        assert check.problem(1, 5.0, True, False) is None
        said = check.problem(2, loss, norm_finite, False)
        assert said.endswith("and the update was applied; the last good step is 1"), said
        assert check.last_good == 1
    assert "loss is nan" in DivergenceCheck(0.0, 3, 10).problem(1, NAN, True, False)
    assert DivergenceCheck(0.0, 3, 10).problem(1, 5.0, False, False).startswith(
        "the gradient norm is not finite and the update was applied; no step was good")


def test_steps_not_applied_are_tolerated_only_between_good_steps():
    good, skipped = (6.0, True, False), (6.0, False, True)
    check = DivergenceCheck(factor=0.0, window=3, max_not_applied=3)
    # Two skipped steps (finite loss: fp16's loss-scale search, or an inf gradient), then a
    # good one: the count starts again, and only good steps are good.
    assert _feed(check, [skipped, (NAN, False, True), good, skipped, skipped]) == [None] * 5
    assert (check.last_good, check.not_applied) == (3, 2)
    said = check.problem(6, INF, False, True)  # the third in a row, whatever its loss
    assert said == ("3 steps in a row whose update was not applied (non-finite gradient norm "
                    "or loss; train.max_nonfinite_steps=3); the last good step is 3")
    # Fewer than the tolerance, but the run's last step: not done either.
    ending = DivergenceCheck(factor=0.0, window=3, max_not_applied=10)
    assert _feed(ending, [good, skipped, (*skipped, True)], start=40) == [None, None, (
        "the run ends on 2 step(s) whose update was not applied (non-finite gradient norm or "
        "loss; tolerated only between good steps); the last good step is 41")]
    assert _feed(DivergenceCheck(0.0, 3, 10), [skipped, (*good, True)]) == [None, None]
    # After a resume the resumed step is the last good one.
    resumed = DivergenceCheck(factor=0.0, window=3, max_not_applied=10, start_step=40)
    assert resumed.problem(41, *skipped) is None
    assert resumed.unsaved(41) == ("step 41 not saved (its update was not applied; the last "
                                   "good step is 40)")


def test_a_loss_beyond_the_factor_of_its_recent_mean_stops():
    check = DivergenceCheck(factor=2.0, window=3, max_not_applied=10)
    # The window fills first (no check while it holds fewer than 3 losses).
    assert _feed(check, [(x, True, False) for x in (1.0, 100.0, 2.0)]) == [None] * 3
    # Mean of (1, 100, 2) = 34.33: 68 is within 2x, then the window is (100, 2, 68).
    assert check.problem(4, 68.0, True, False) is None
    mean = (100.0 + 2.0 + 68.0) / 3
    assert check.problem(5, 2 * mean, True, False) is None  # equal to the bound: allowed
    mean = (2.0 + 68.0 + 2 * (100.0 + 2.0 + 68.0) / 3) / 3
    message = check.problem(6, 2 * mean * 1.001, True, False)
    assert "train.divergence_factor=2" in message and "last 3 steps" in message
    assert message.endswith("; the last good step is 5") and check.last_good == 5
    # Non-finite losses of skipped steps never enter the mean; factor 0 never checks.
    off = DivergenceCheck(factor=0.0, window=1, max_not_applied=10)
    assert _feed(off, [(x, True, False) for x in (1.0, 1e6, 1e12)]) == [None] * 3
    skipping = DivergenceCheck(factor=2.0, window=1, max_not_applied=10)
    assert _feed(skipping, [(1.0, True, False), (NAN, False, True), (1.9, True, False)]) == \
        [None] * 3  # 1.9 against 1.0, not NaN


def test_divergence_settings_are_checked():
    config = load_config(str(ROOT / "configs" / "tiny.yaml"), [])
    for key, value in (("divergence_factor", 0.5), ("divergence_factor", 1.0),
                       ("divergence_factor", -1.0), ("divergence_factor", INF),
                       ("max_weight_abs", 0.0), ("max_weight_abs", NAN),
                       ("divergence_window", 0)):
        bad = load_config(str(ROOT / "configs" / "tiny.yaml"), [f"train.{key}={value}"])
        with pytest.raises(ConfigError, match=f"train.{key}"):
            check_ranges(bad)
    check_ranges(config)
    check_ranges(load_config(str(ROOT / "configs" / "tiny.yaml"),
                             ["train.divergence_factor=0"]))  # off


# -- the good-checkpoint rule ---------------------------------------------------------------
def _parameters() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(7, 5), torch.randn(3).bfloat16() * 40, torch.empty(0),
            torch.randn(2, 2, dtype=torch.float64)]


def test_weights_max_abs_matches_plain_torch():
    params = _parameters()
    reference = max(p.double().abs().max().item() for p in params if p.numel())
    assert weights_max_abs(params) == reference
    params[0][3, 1] = -1e30  # finite, far beyond any trained weight
    assert weights_max_abs(params) == pytest.approx(1e30, rel=1e-6)
    for value in (NAN, INF, -INF):
        broken = _parameters()
        broken[1][2] = value
        assert weights_max_abs(broken) == INF, value
    assert weights_max_abs([]) == 0.0


def test_check_weights_refuses_beyond_the_limit_and_names_what_latest_keeps(tmp_path):
    params = _parameters()
    largest = weights_max_abs(params)
    check_weights(params, 5, largest, tmp_path)  # at the limit: good
    with pytest.raises(DivergenceError, match=r"step 5: the largest \|weight\| is .*beyond "
                       r"train.max_weight_abs=.*no checkpoint is kept"):
        check_weights(params, 5, largest * 0.99, tmp_path)
    (tmp_path / "latest").write_text("step_00000004\n")
    params[2] = torch.tensor([NAN])
    with pytest.raises(DivergenceError, match="step 5: some weights are inf or NaN; not saved; "
                       "stopping. .*latest still names step_00000004"):
        check_weights(params, 5, INF, tmp_path)


# -- real runs ------------------------------------------------------------------------------
# train.py's main() in a process of its own; `blow_up_after` multiplies every weight by 1e30
# after that step's update (what a huge learning rate does to a run whose losses stay finite
# for a step).
DRIVER = """
import os
import sys
import torch
from megatron_rembert import train
from megatron_rembert.training import engine

blow_up_after = {blow_up_after!r}
real_step = engine.Trainer.train_step
calls = {{"n": 0}}

def step(self, batches):
    stats = real_step(self, batches)
    calls["n"] += 1
    if calls["n"] == blow_up_after:
        with torch.no_grad():
            for p in self.engine.module.parameters():
                p.mul_(1e30)
    return stats

engine.Trainer.train_step = step
code = train.main(sys.argv[1:])
print(f"process groups left: {{torch.distributed.is_initialized()}}")
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)  # as train.console_main ends: no interpreter teardown (gloo's aborted now and then)
"""


def _args(tmp: Path, tiny_dataset, **sets) -> list[str]:
    data, tokenizer = tiny_dataset
    values = {"data.path": data, "data.tokenizer": tokenizer, "data.seq_length": SEQ,
              "data.num_workers": 0, "train.steps": 4, "train.global_batch_size": 4,
              "train.micro_batch_size": 2, "train.eval_interval": 0, "train.log_interval": 1,
              "train.save_interval": 1, "train.precision": "fp32",
              "train.save_dir": tmp / "run" / "ckpt", "train.log_dir": tmp / "run" / "logs",
              **sets}
    args = ["--config", "configs/tiny.yaml"]
    for key, value in values.items():
        args += ["--set", f"{key}={value}"]
    return args


def _hashes(*roots: Path, skip: Path) -> dict[str, str]:
    """Every file under `roots` but not under `skip` (the run's folders), by content."""
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for root in roots for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_relative_to(skip)}


def _saved(tmp: Path) -> tuple[str | None, list[str]]:
    ckpt = tmp / "run" / "ckpt"
    latest = ckpt / "latest"
    return (latest.read_text().strip() if latest.exists() else None,
            sorted(p.name for p in ckpt.glob("step_*")))


# (id, settings, blow_up_after, what the error line names, the step folders kept)
RUNS = [
    # The attack: NaN from step 2; the run used to print "done at step 4" and exit 0. Each
    # such step is skipped (a non-finite gradient norm), and a run ending on them stops.
    ("nan-from-step-2-short-run", {"optim.lr": 1e6, "optim.warmup_steps": 0,
                                   "train.save_interval": 0}, None,
     "step 4: the run ends on 3 step(s) whose update was not applied (non-finite gradient "
     "norm or loss; tolerated only between good steps); the last good step is 1; stopping. "
     "no checkpoint is kept", []),
    # The same learning rate, saving every step: step 1's loss is finite, its weights ~1e6.
    ("huge-lr-weights-refused-at-first-save", {"optim.lr": 1e6, "optim.warmup_steps": 0},
     None, "step 1: the largest |weight| is 1e+06, beyond train.max_weight_abs=10000", []),
    # Weights ~1e30 (finite, so a finiteness check passes) after step 2: step 1 stays latest.
    ("finite-1e30-weights-keep-the-last-good-step", {}, 2,
     "step 2: the largest |weight| is", ["step_00000001"]),
    # The same with background saves: the weights are checked on their host copy in the
    # writer; step 3 goes on, and its save, waiting for step 2's, stops the run.
    ("finite-1e30-weights-background-save", {"train.async_save": True}, 2,
     "step 2: the largest |weight| is", ["step_00000001"]),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", RUNS, ids=[r[0] for r in RUNS])
def test_a_diverged_run_stops_with_one_error_line(case, tmp_path, tiny_dataset):
    _, sets, blow_up_after, names, kept = case
    neighbour = tmp_path / "neighbour.txt"
    neighbour.write_text("another run's file")
    before = _hashes(tmp_path, *(p.parent for p in tiny_dataset), skip=tmp_path / "run")
    run = subprocess.run([sys.executable, "-c", DRIVER.format(blow_up_after=blow_up_after),
                          *_args(tmp_path, tiny_dataset, **sets)],
                         cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert run.returncode == 2, run.stdout + run.stderr
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and names in errors[0], run.stderr
    assert "Traceback" not in run.stderr and "done at step" not in run.stdout
    # Ended by the run, not left to the interpreter's teardown (which aborted now and then).
    assert "process groups left: False" in run.stdout, run.stdout
    latest, folders = _saved(tmp_path)
    assert folders == kept and latest == (kept[-1] if kept else None)
    if kept:
        assert f"latest still names {kept[-1]}, the last good checkpoint" in errors[0]
    assert _hashes(tmp_path, *(p.parent for p in tiny_dataset),
                   skip=tmp_path / "run") == before


def _train_main(rank, world_size, argv):
    """train.py's main() on one of the ranks: its exit code and what it printed to stderr."""
    from megatron_rembert import train

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = train.main(argv)
    return code, err.getvalue()


@pytest.mark.multiprocess
def test_a_loss_jump_stops_every_rank_at_the_same_step(tmp_path, tiny_dataset):
    """train.divergence_factor over a window of 1 step, two data-parallel ranks: both stop at
    the first step whose logged loss exceeds 1.001 x the step before (found here from
    metrics.jsonl), each with one error line, and `latest` names the step before."""
    from tests.distributed import run_distributed

    factor = 1.001
    argv = _args(tmp_path, tiny_dataset, **{"train.steps": 10, "train.global_batch_size": 8,
                                            "train.divergence_factor": factor,
                                            "train.divergence_window": 1})
    results = run_distributed(_train_main, 2, argv, timeout=400)
    rows = [json.loads(line) for line in
            (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if r["split"] == "train"}
    jumps = [s for s in sorted(losses) if s > 1 and losses[s] > factor * losses[s - 1]]
    assert jumps, losses  # the run must have stopped at one
    stop = jumps[0]
    assert max(losses) == stop and all(math.isfinite(v) for v in losses.values())
    lines = []
    for code, err in results:
        errors = [line for line in err.splitlines() if "error:" in line]
        assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
        lines.append(errors[0])
    assert lines[0] == lines[1]
    assert lines[0].startswith(f"error: step {stop}: the loss ") and "divergence_factor" in lines[0]
    latest, folders = _saved(tmp_path)
    assert latest == f"step_{stop - 1:08d}" and f"step_{stop:08d}" not in folders
    assert f"latest still names step_{stop - 1:08d}" in lines[0]
