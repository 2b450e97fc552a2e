"""The step-folder protocol and the save_dir lock, on plain files (no model)."""

import errno
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from megatron_rembert.checkpoint import CheckpointError, step_folder
from megatron_rembert.checkpoint import lock as lock_module
from megatron_rembert.checkpoint.lock import SaveDirLock

META = {"config": {"model": {"preset": "tiny"}}, "layout": {"tp": 1, "pp": 1, "dp": 1},
        "consumed_samples": 0}


def _save(save_dir, step, keep_last=10):
    """A complete step folder the way a save commits it (one data file)."""
    folder = save_dir / step_folder.step_tag(step)
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_bytes(bytes([step]) * 64)
    step_folder.commit(save_dir, folder, {**META, "step": step}, {}, keep_last)
    return folder


def _steps(save_dir):
    return sorted(p.name for p in save_dir.glob("step_*"))


def test_keep_last_never_deletes_latest_or_newer(tmp_path):
    for step in (2, 4, 6):
        _save(tmp_path, step)
    (tmp_path / "latest").write_text("step_00000002\n")  # `latest` set back by hand
    _save(tmp_path, 3, keep_last=1)
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"
    # Step 2 is older than latest and beyond keep_last; 4 and 6 are newer: kept.
    assert _steps(tmp_path) == ["step_00000003", "step_00000004", "step_00000006"]


def test_roll_back_moves_newer_folders_aside(tmp_path):
    for step in (2, 4, 6):
        _save(tmp_path, step)
    moved = step_folder.roll_back(tmp_path, tmp_path / "step_00000004")
    assert [p.name for p in moved] == ["step_00000006"]
    assert moved[0].parent.parent == tmp_path / step_folder.ROLLED_BACK and moved[0].is_dir()
    assert (tmp_path / "latest").read_text().strip() == "step_00000004"
    aside = list((tmp_path / step_folder.ROLLED_BACK).glob("*/step_00000006"))
    assert len(aside) == 1 and (aside[0] / "complete").exists()  # moved, not deleted
    _save(tmp_path, 5, keep_last=2)  # the next save after the roll-back prunes nothing newer
    assert step_folder.find_latest(tmp_path).path.name == "step_00000005"
    # A restart with the same train.resume_from (a requeued job) keeps the progress since.
    assert step_folder.roll_back(tmp_path, tmp_path / "step_00000004") is None
    assert step_folder.find_latest(tmp_path).path.name == "step_00000005"
    with pytest.raises(CheckpointError, match="not a step folder of"):
        step_folder.roll_back(tmp_path, aside[0])


def test_manifest_names_the_file_that_differs(tmp_path):
    folder = _save(tmp_path, 1)
    files = json.loads((folder / "manifest.json").read_text())["files"]
    assert sorted(files) == ["meta.json", "weights.bin"]
    assert step_folder.verify(folder)
    data = bytearray((folder / "weights.bin").read_bytes())
    data[10] ^= 0xFF
    (folder / "weights.bin").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"weights.bin: sha256 differs"):
        step_folder.verify(folder)
    (folder / "weights.bin").write_bytes(bytes(data[:-1]))
    with pytest.raises(CheckpointError, match=r"weights.bin: 63 bytes, .* says 64"):
        step_folder.verify(folder)
    (folder / "extra.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"extra.pt: not in"):
        step_folder.verify(folder)
    os.remove(folder / "manifest.json")  # a checkpoint from before manifests
    assert step_folder.verify(folder) is False


def test_a_step_folder_is_resolved_once_with_its_meta(tmp_path, monkeypatch):
    """A step folder or a save folder (its `latest`) gives one StepFolder: the folder and its
    meta, meta.json read once; incomplete folders and save folders without `latest` refused."""
    reads = []
    real_read = step_folder.read_meta
    monkeypatch.setattr(step_folder, "read_meta", lambda f: reads.append(f) or real_read(f))
    for step in (1, 2):
        _save(tmp_path / "run", step)
    for given in (tmp_path / "run", tmp_path / "run" / "step_00000002"):
        reads.clear()
        resolved = step_folder.resolve_checkpoint(given)
        assert resolved.path == tmp_path / "run" / "step_00000002"
        assert resolved.meta == {**META, "step": 2}
        assert reads == [resolved.path]
    assert step_folder.find_latest(tmp_path / "run") == resolved
    assert step_folder.find_latest(tmp_path / "nothing") is None
    (tmp_path / "run" / "latest").unlink()
    with pytest.raises(CheckpointError, match="a save folder without 'latest'"):
        step_folder.resolve_checkpoint(tmp_path / "run")
    (tmp_path / "run" / "step_00000001" / "complete").unlink()
    with pytest.raises(CheckpointError, match="no 'complete' marker"):
        step_folder.StepFolder.open(tmp_path / "run" / "step_00000001")


def test_meta_without_a_section_is_one_clear_error(tmp_path):
    folder = _save(tmp_path, 1)
    meta = json.loads((folder / "meta.json").read_text())
    del meta["layout"]
    (folder / "meta.json").write_text(json.dumps(meta))
    step_folder.write_manifest(folder, {})  # the manifest agrees: the sections check speaks
    with pytest.raises(CheckpointError, match=r"meta.json: no layout in it"):
        step_folder.read_meta(folder)


@pytest.mark.parametrize("damage", ["edited", "truncated"])
def test_meta_is_checked_against_the_manifest_before_it_is_read(tmp_path, damage):
    """A hand-edited meta.json (here: a model that is no longer a mapping, which every reader
    would trip over) or a truncated one is named by the manifest check, before its values."""
    folder = _save(tmp_path, 1)
    path = folder / "meta.json"
    meta = json.loads(path.read_text())
    if damage == "edited":
        path.write_text(json.dumps({**meta, "config": {**meta["config"], "model": "tiny"}}))
    else:
        path.write_bytes(path.read_bytes()[:-3])
    # The size differs (or else the sha256): either way the manifest names the file.
    match = r"meta.json: (\d+ bytes, |sha256 differs from ).*manifest.json"
    with pytest.raises(CheckpointError, match=match):
        step_folder.read_meta(folder)
    with pytest.raises(CheckpointError, match=match):
        step_folder.find_latest(tmp_path)


@pytest.mark.multiprocess
def test_second_holder_refused_stale_lock_taken_over(tmp_path):
    with SaveDirLock(tmp_path / "run"):
        with pytest.raises(CheckpointError, match=rf"in use by pid {os.getpid()} on host "
                                                  rf"{socket.gethostname()}"):
            SaveDirLock(tmp_path / "run").acquire()
    assert not (tmp_path / "run" / ".lock").exists()  # released
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "run" / ".lock").write_text(json.dumps(
        {"host": socket.gethostname(), "pid": dead.pid, "since": "earlier"}))
    with SaveDirLock(tmp_path / "run") as lock:  # its holder is dead: stale
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()


def test_read_only_save_dir_found_when_locking(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(lock_module.os, "open", read_only)
    with pytest.raises(CheckpointError, match=r"train.save_dir=.*: not writable \(Read-only"):
        SaveDirLock(tmp_path).acquire()


def test_an_unwritten_lock_is_stale_once_old_enough(tmp_path):
    """A lock file without its owner's record (the owner was killed between creating it and
    writing it: empty, or cut off) is taken over once older than UNWRITTEN_SECONDS; a younger
    one may be a run taking the lock right now, and is one error naming the lock file."""
    lock = tmp_path / "run" / ".lock"
    lock.parent.mkdir()
    for content in ("", '{"host": "no'):
        lock.write_text(content)
        with pytest.raises(CheckpointError, match=r"\.lock has no owner record yet"):
            SaveDirLock(tmp_path / "run").acquire()
        old = time.time() - lock_module.UNWRITTEN_SECONDS - 1
        os.utime(lock, (old, old))
        with SaveDirLock(tmp_path / "run"):  # stale: taken over
            assert json.loads(lock.read_text())["pid"] == os.getpid()
        assert not lock.exists()


def test_a_lock_whose_record_fails_to_write_is_not_left_behind(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lock_module.json, "dump", full_disk)
    with pytest.raises(CheckpointError, match=r"not writable \(No space left on device"):
        SaveDirLock(tmp_path / "run").acquire()
    assert not (tmp_path / "run" / ".lock").exists()


def test_a_requeued_slurm_job_takes_over_its_own_lock_only(tmp_path):
    """A lock taken on another host by this SLURM job (an earlier incarnation, before a
    requeue) is stale and taken over; one of another job, or seen outside SLURM, is refused.
    The job id comes from the launcher's variables as read once (launch_env), not from here."""
    lock = tmp_path / "run" / ".lock"
    lock.parent.mkdir()
    record = {"host": "another-node", "pid": 12345, "slurm_job": "4711", "since": "earlier"}
    for job in ("4712", None):
        lock.write_text(json.dumps(record))
        with pytest.raises(CheckpointError, match=r"in use by pid 12345 on host another-node"):
            SaveDirLock(tmp_path / "run", job=job).acquire()
    with SaveDirLock(tmp_path / "run", job="4711"):
        assert json.loads(lock.read_text())["slurm_job"] == "4711"
    assert not lock.exists()
