"""Preprocessing is atomic and restartable: a kill at any moment, then a rerun, gives exactly
the dataset of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rembert.data.common import DataError
from megatron_rembert.data.preprocess import preprocess
from tests.data.conftest import small_config

ROOT = Path(__file__).resolve().parents[2]


def _shards(manifest: dict) -> list[tuple]:
    return [(s["file"], s["rows"], s["tokens"], s["sha256"]) for s in manifest["shards"]]


def _child(corpus, out, tokenizer) -> subprocess.Popen:
    code = ("import sys; from megatron_rembert.data.preprocess import preprocess;"
            "from tests.data.conftest import small_config;"
            "preprocess(small_config(sys.argv[1], sys.argv[2], sys.argv[3]))")
    return subprocess.Popen([sys.executable, "-c", code, str(corpus), str(out), str(tokenizer)],
                            cwd=ROOT, stderr=subprocess.DEVNULL)


def test_kill_and_resume_gives_identical_shards(corpus, tokenizer, dataset, tmp_path):
    reference = json.loads((dataset / "manifest.json").read_text())
    out = tmp_path / "out"
    kills = 0
    for wanted in (2, 8, 20, 35):  # kill after at least this many shard files exist
        proc = _child(corpus, out, tokenizer)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            if len(list(out.rglob("*.arrow"))) >= wanted:
                proc.send_signal(signal.SIGKILL)
                kills += 1
                break
            time.sleep(0.005)
        proc.wait()
        assert not (out / "manifest.json").exists() or proc.returncode == 0
    assert kills >= 2, "the run finished before it could be killed; make it longer"
    (out / "train" / "cyrl").mkdir(parents=True, exist_ok=True)
    (out / "train" / "cyrl" / ".tmp-999-cyrl-train-00000.arrow").write_bytes(b"half a shard")
    manifest = preprocess(small_config(corpus, out, tokenizer))
    assert _shards(manifest) == _shards(reference)
    assert manifest["languages"] == reference["languages"]
    assert manifest["skipped"] == reference["skipped"]
    assert not list(out.rglob(".tmp-*"))
    listed = {s["file"] for s in manifest["shards"]}
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*.arrow")}
    assert on_disk == listed  # no duplicates or orphans


def test_rerun_skips_finished_work(corpus, tokenizer, tmp_path):
    cfg = small_config(corpus, tmp_path / "out", tokenizer, languages=["grek", "hang"])
    first = preprocess(cfg)
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "out").rglob("*.arrow")}
    second = preprocess(cfg)
    assert _shards(first) == _shards(second)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "out").rglob("*.arrow")} == mtimes


def test_other_settings_need_overwrite(corpus, tokenizer, tmp_path):
    preprocess(small_config(corpus, tmp_path / "out", tokenizer, languages=["grek"]))
    with pytest.raises(DataError, match="seq_length"):
        preprocess(small_config(corpus, tmp_path / "out", tokenizer, languages=["grek"],
                                seq_length=32))
    m = preprocess(small_config(corpus, tmp_path / "out", tokenizer, languages=["grek"],
                                seq_length=32, overwrite=True))
    assert m["seq_length"] == 32
    assert all(os.path.exists(tmp_path / "out" / s["file"]) for s in m["shards"])
