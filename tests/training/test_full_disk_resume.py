"""After a full disk is freed, the same command continues from the last good checkpoint (issue
"Nothing ends done that did not train", class D): a real run of train.py on 2 ranks saves at
step 2, the disk fills up during the step-4 save (tests/training/failing_train.py, in two of
the writes a save makes: a torch.save on rank 1, our optimizer shard file on rank 1 half
written, and the same on rank 0 on DeepSpeed's own ZeRO-2 path),
the run stops with its error line; the same command run again without the fault resumes from
step 2 and finishes with the losses of a run that never failed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rembert.checkpoint.step_folder import find_latest
from tests.training.production import data_overrides
from tests.training.test_failure_table import Row, _launch

pytestmark = pytest.mark.multiprocess  # every test here runs train.py on 2 ranks

STEPS, SAVE_EVERY = 4, 2


def _run(row: Row, sets: dict, out: Path) -> list[int]:
    out.mkdir(parents=True)
    procs, _ = _launch(row, sets, out)
    try:
        return [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _sets(tiny_dataset, run: Path) -> dict:
    return {**data_overrides(*tiny_dataset, run, STEPS), "train.save_interval": SAVE_EVERY,
            "train.eval_interval": 0}


def _losses(run: Path) -> dict[int, float]:
    """The loss logged at each step (the last row of a step logged twice)."""
    rows = (run / "logs" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, rows) if r["split"] == "train"}


@pytest.fixture(scope="module")
def uninterrupted(tiny_dataset, tmp_path_factory):
    """The losses of a run that never failed."""
    root = tmp_path_factory.mktemp("uninterrupted")
    codes = _run(Row("plain", 2, []), _sets(tiny_dataset, root / "run"), root / "out")
    assert codes == [0, 0], (root / "out" / "rank0.err").read_text()[-3000:]
    return _losses(root / "run")


@pytest.mark.parametrize("failure, rank", [("checkpoint-disk-full", 1),
                                           ("optimizer-shard-disk-full", 1),
                                           ("optimizer-shard-disk-full", 0)])
def test_rerun_after_a_full_disk_continues_from_the_last_good_checkpoint(
        failure, rank, uninterrupted, tiny_dataset, tmp_path, monkeypatch):
    run = tmp_path / "run"
    sets = _sets(tiny_dataset, run)
    monkeypatch.setenv("FAILING_SAVE", "step_00000004")
    codes = _run(Row(failure, 2, [], failure=failure, failing_rank=rank), sets,
                 tmp_path / "full")
    err = (tmp_path / "full" / f"rank{rank}.err").read_text()
    assert codes[rank] != 0 and "still names the last good checkpoint" in err, err[-3000:]
    assert find_latest(run / "ckpt").path.name == "step_00000002"
    assert not (run / "ckpt" / "step_00000004").exists()
    # The disk has room again: the same command, as a requeue would run it.
    codes = _run(Row("plain", 2, []), sets, tmp_path / "again")
    out = (tmp_path / "again" / "rank0.out").read_text()
    assert codes == [0, 0], (tmp_path / "again" / "rank0.err").read_text()[-3000:]
    assert f"resumed from {run / 'ckpt' / 'step_00000002'} (step 2" in out, out
    assert find_latest(run / "ckpt").path.name == "step_00000004"
    losses, expected = _losses(run), uninterrupted
    assert [losses[s] for s in range(1, STEPS + 1)] == [expected[s] for s in range(1, STEPS + 1)]
