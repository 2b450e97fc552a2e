"""A shard that fails its checksum while training: train.py stops with one error line before
any optimizer step, and saves nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.data.test_loader import flip_one_token_per_shard
from tests.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_train_py_stops_on_a_modified_shard(dataset, tokenizer, tmp_path):
    copy = tmp_path / "ds"
    shutil.copytree(dataset, copy)
    flip_one_token_per_shard(copy)  # in range: only the sha256 tells
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
    assert "-train-" in errors[0] and "sha256 differs from the manifest" in errors[0]
    assert not list((tmp_path / "ckpt").glob("step_*"))  # no step was taken, none saved
