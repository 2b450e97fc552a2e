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

from megatron_rembert import fs
from megatron_rembert.data import shards
from megatron_rembert.data.common import DataError
from megatron_rembert.prep import preprocess as preprocess_mod
from megatron_rembert.prep.preprocess import preprocess
from tests.data.conftest import small_config

ROOT = Path(__file__).resolve().parents[2]


def _shards(manifest: dict) -> list[tuple]:
    return [(s["file"], s["rows"], s["tokens"], s["sha256"]) for s in manifest["shards"]]


def _child(corpus, out, tokenizer) -> subprocess.Popen:
    code = ("import sys; from megatron_rembert.prep.preprocess import preprocess;"
            "from tests.data.conftest import small_config;"
            "preprocess(small_config(sys.argv[1], sys.argv[2], sys.argv[3]))")
    return subprocess.Popen([sys.executable, "-c", code, str(corpus), str(out), str(tokenizer)],
                            cwd=ROOT, stderr=subprocess.DEVNULL)


@pytest.mark.multiprocess
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


class _Killed(BaseException):
    """Stands for a SIGKILL: nothing in preprocess catches it and nothing after it runs."""


@pytest.mark.parametrize("where", ["after_write", "before_rename"])
def test_kill_between_any_two_writes_gives_identical_shards(corpus, tokenizer, tmp_path,
                                                            monkeypatch, where):
    """Deterministic version of the test above: stop the run at each of its file writes in turn
    (shards, checkpoint arrays, checkpoint json, ...), either right after the write or with only
    a partial temp file written, rerun, and compare with an uninterrupted run. In particular this
    covers a kill after a checkpoint's arrays are on disk but before its json commits them."""
    langs = ["cyrl", "grek"]  # two languages: a kill in the second one resumes after a done one

    def cfg(out):
        return small_config(corpus, out, tokenizer, languages=langs, workers=0)

    reference = preprocess(cfg(tmp_path / "ref"))
    real_write = fs.atomic_write
    writes: list[str] = []
    kill_at = [0]  # 1-based index of the write that is interrupted; 0: none

    def write(path, fn, binary=True):
        writes.append(Path(path).name)
        if len(writes) == kill_at[0] and where == "before_rename":
            tmp = Path(path).with_name(f".tmp-{os.getpid()}-{Path(path).name}")
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(b"half a file")
            raise _Killed
        real_write(path, fn, binary)
        if len(writes) == kill_at[0]:
            raise _Killed

    for module in (fs, shards, preprocess_mod):  # fs: atomic_write_json's
        monkeypatch.setattr(module, "atomic_write", write)
    preprocess(cfg(tmp_path / "count"))
    names = list(writes)
    assert any(n.endswith(".npz") for n in names) and "cyrl.json" in names
    for crash_at in range(1, len(names) + 1):
        out = tmp_path / f"run{crash_at}"
        writes.clear()
        kill_at[0] = crash_at
        with pytest.raises(_Killed):
            preprocess(cfg(out))
        writes.clear()
        kill_at[0] = 0
        manifest = preprocess(cfg(out))
        context = f"killed {where.replace('_', ' ')} #{crash_at} ({names[crash_at - 1]})"
        assert manifest == reference, context
        assert not list(out.rglob(".tmp-*")), context
        on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*.arrow")}
        assert on_disk == {s["file"] for s in manifest["shards"]}, context
        progress = sorted(p.name for p in (out / ".progress").iterdir())
        state = {lang: json.loads((out / ".progress" / f"{lang}.json").read_text())
                 for lang in langs}
        assert progress == sorted(["settings.json", *(f"{lang}.json" for lang in langs),
                                   *(st["arrays"] for st in state.values())]), context


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


def test_full_disk_is_one_line_and_a_rerun_resumes(corpus, tokenizer, tmp_path, monkeypatch,
                                                   capsys):
    """A full disk in the middle of preprocessing: the preprocess command prints one `error:`
    line naming the file (exit 1, no traceback); the same command rerun finishes with exactly
    the dataset of an uninterrupted run."""
    import errno

    from megatron_rembert.prep.commands import preprocess as tool

    def run(out) -> int:
        return tool(["--corpus", str(corpus), "--tokenizer", str(tokenizer),
                          "--out", str(out), "--seq-length", "64", "--workers", "0",
                          "--shard-size-mb", "0.02", "--languages", "cyrl", "grek",
                          "--no-progress"])

    assert run(tmp_path / "ref") == 0
    reference = json.loads((tmp_path / "ref" / "manifest.json").read_text())
    real_write, writes = fs.atomic_write, []

    def write(path, fn, binary=True):
        writes.append(path)
        if len(writes) == 4:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, fn, binary)

    for module in (fs, shards, preprocess_mod):
        monkeypatch.setattr(module, "atomic_write", write)
    capsys.readouterr()
    assert run(tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert f"{writes[3]}: No space left on device" in err, err
    for module in (fs, shards, preprocess_mod):
        monkeypatch.setattr(module, "atomic_write", real_write)
    assert run(tmp_path / "out") == 0
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == reference
