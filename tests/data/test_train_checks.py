"""Bad shards through train.py: one error line naming the file, exit 2, no traceback, nothing
saved. A missing validation shard is found at start-up (before the model is built); a shard
that fails its checksum stops the run before any optimizer step."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.data.conftest import shard_entries
from tests.data.test_loader import flip_one_token_per_shard
from tests.distributed import free_port

pytestmark = pytest.mark.multiprocess  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]


def _remove_a_validation_shard(data_dir: Path) -> None:
    (data_dir / shard_entries(data_dir, "valid")[-1]["file"]).unlink()


@pytest.mark.parametrize("damage, message", [
    (_remove_a_validation_shard, r"-valid-\d+\.arrow listed in the manifest is missing"),
    (flip_one_token_per_shard, r"-train-\d+\.arrow: sha256 differs from the manifest"),
], ids=["missing-valid-shard", "modified-train-shard"])
def test_train_py_stops_on_a_bad_shard(dataset, tokenizer, tmp_path, damage, message):
    copy = tmp_path / "ds"
    shutil.copytree(dataset, copy)
    damage(copy)
    sets = {"data.path": copy, "data.tokenizer": tokenizer, "data.num_workers": 1,
            "train.steps": 2, "train.global_batch_size": 4, "train.micro_batch_size": 2,
            "train.save_interval": 1, "train.eval_interval": 0,
            "train.save_dir": tmp_path / "ckpt", "train.log_dir": tmp_path / "logs"}
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    env = {**os.environ, "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.yaml", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2, run.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert re.search(message, errors[0]), errors[0]
    assert not list((tmp_path / "ckpt").glob("step_*"))  # no step was taken, none saved
