"""Paths read from files stay inside their folder (fs.inside), and a save never writes through
a link (issue 30), on plain files: `latest`, a step folder's manifest.json, the save paths,
pruning beside stray entries."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_rembert import fs
from megatron_rembert.checkpoint import CheckpointError, step_folder
from megatron_rembert.errors import UserError

META = {"config": {"model": {"preset": "tiny"}}, "layout": {"tp": 1, "pp": 1, "dp": 1},
        "consumed_samples": 0}


def _save(save_dir: Path, step: int, keep_last: int = 10) -> Path:
    folder = save_dir / step_folder.step_tag(step)
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_bytes(bytes([step]) * 64)
    step_folder.commit(save_dir, folder, {**META, "step": step}, {}, keep_last)
    return folder


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b""
            for p in sorted(folder.rglob("*"))}


class _Refused(UserError):
    pass


# -- the rule ------------------------------------------------------------------------------------
def test_inside_accepts_names_that_stay_and_refuses_the_rest(tmp_path):
    folder, outside = tmp_path / "folder", tmp_path / "outside"
    (folder / "sub").mkdir(parents=True)
    outside.mkdir()
    (folder / "sub" / "a.bin").write_bytes(b"a")
    (outside / "b.bin").write_bytes(b"b")
    os.symlink(folder / "sub" / "a.bin", folder / "link_in")  # a link that stays inside
    os.symlink(outside / "b.bin", folder / "link_out")
    os.symlink(outside, folder / "dir_out")
    named_in = folder / "manifest.json"
    for name in ("sub/a.bin", "link_in", "./sub/a.bin", "not_yet_written.bin"):
        assert fs.inside(folder, name, named_in, _Refused) == folder / name
    refused = {str(outside / "b.bin"): "an absolute path", "../outside/b.bin": "'..'",
               "sub/../../outside/b.bin": "'..'", "link_out": "through a symlink",
               "dir_out/b.bin": "through a symlink", "dir_out/new.bin": "through a symlink",
               "": "not a file name", ".": "the folder itself", "a\0b": "not a file name"}
    for name, why in refused.items():
        with pytest.raises(_Refused, match=why) as caught:
            fs.inside(folder, name, named_in, _Refused)
        assert str(caught.value).startswith(f"{named_in}: names {name!r}")
        assert "\n" not in str(caught.value)
    for name in (None, 3, ["a"]):
        with pytest.raises(_Refused, match="not a file name"):
            fs.inside(folder, name, named_in, _Refused)


# -- latest ----------------------------------------------------------------------------------------
@pytest.fixture
def two_runs(tmp_path) -> tuple[Path, Path]:
    """(this run's empty save folder, another run's with complete steps 2 and 4)."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    for step in (2, 4):
        _save(other, step)
    return mine, other


@pytest.mark.parametrize("how", ["absolute", "dotdot", "step-folder-link", "latest-is-link"])
def test_latest_leading_out_of_the_save_folder_is_refused(how, two_runs):
    mine, other = two_runs
    if how == "absolute":
        (mine / "latest").write_text(f"{other / 'step_00000002'}\n")
    elif how == "dotdot":
        (mine / "latest").write_text("../other/step_00000002\n")
    elif how == "step-folder-link":
        os.symlink(other / "step_00000002", mine / "step_00000002")
        (mine / "latest").write_text("step_00000002\n")
    else:  # `latest` itself a link to the other run's: its name is read in this folder
        os.symlink(other / "latest", mine / "latest")
        os.symlink(other / "step_00000004", mine / "step_00000004")
    for find in (step_folder.find_latest, step_folder.resolve_checkpoint):
        with pytest.raises(CheckpointError, match="must stay inside") as caught:
            find(mine)
        assert str(caught.value).startswith(f"{mine / 'latest'}: names")


def test_latest_naming_a_link_that_stays_inside_is_followed(two_runs):
    mine, _ = two_runs
    real = _save(mine, 2)
    os.symlink(real, mine / "step_00000003")
    (mine / "latest").write_text("step_00000003\n")
    assert step_folder.find_latest(mine).meta["step"] == 2


def test_unreadable_latest_is_one_checkpoint_error(tmp_path):
    (tmp_path / "latest").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CheckpointError, match="latest: unreadable"):
        step_folder.find_latest(tmp_path)


# -- a step folder's manifest -------------------------------------------------------------------
def test_verify_refuses_a_manifest_naming_a_file_outside(tmp_path):
    """A hand-edited manifest.json listing `../x` (an exact copy of a real file, so size and
    hash match) must not make verify vouch for a file of another folder."""
    folder = _save(tmp_path, 2)
    (tmp_path / "outside.bin").write_bytes((folder / "weights.bin").read_bytes())
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["../outside.bin"] = manifest["files"]["weights.bin"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="'..'") as caught:
        step_folder.verify(folder)
    assert str(caught.value).startswith(f"{folder / 'manifest.json'}: names '../outside.bin'")


# -- saving never writes through a link ------------------------------------------------------
def test_save_paths_are_cleared_without_following_links(two_runs):
    mine, other = two_runs
    before = _snapshot(other)
    os.symlink(other / "step_00000002", mine / "step_00000002")
    os.symlink(other / "weights.bin", mine / "zero_to_fp32.py")  # an own name (old saves)
    (mine / "step_00000004").mkdir()  # a partial folder of a killed save: removed
    (mine / "step_00000004" / "half.pt").write_bytes(b"x")
    step_folder.clear_save_paths(mine, mine / "step_00000002")
    step_folder.clear_save_paths(mine, mine / "step_00000004")
    assert sorted(os.listdir(mine)) == []
    assert _snapshot(other) == before


def test_atomic_write_replaces_links_never_writes_through_them(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "latest")
    # A link planted where the temp file of this process will be written.
    os.symlink(victim, tmp_path / f".tmp-{os.getpid()}-meta.json")
    fs.atomic_write(tmp_path / "latest", lambda f: f.write("step_00000002\n"), binary=False)
    fs.atomic_write(tmp_path / "meta.json", lambda f: f.write(b"{}"))
    assert victim.read_text() == "precious"
    assert not (tmp_path / "latest").is_symlink()
    assert (tmp_path / "latest").read_text() == "step_00000002\n"
    assert (tmp_path / "meta.json").read_bytes() == b"{}"


def test_stray_entries_are_listed_and_ignored_by_every_save(two_runs):
    """A copied `step_X.bak`, a stray file and a link: listed once for a notice; saving,
    pruning (keep_last=1) and rolling back go on, leaving them and the link's target alone."""
    mine, other = two_runs
    _save(mine, 1)
    (mine / "step_00000001.bak").mkdir()
    (mine / "step_00000001.bak" / "complete").write_text("")
    (mine / "notes.txt").write_text("mine")
    os.symlink(other / "step_00000002", mine / "step_00000009")
    before = _snapshot(other)
    for step in (3, 5):
        _save(mine, step, keep_last=1)
    assert step_folder.unexpected_entries(mine) == ["notes.txt", "step_00000001.bak/",
                                                    "step_00000009"]
    assert [p.name for p in step_folder.step_folders(mine)] == ["step_00000005"]
    assert step_folder.roll_back(mine, mine / "step_00000005") == []
    assert (mine / "step_00000001.bak" / "complete").exists()
    assert (mine / "notes.txt").read_text() == "mine"
    assert (mine / "step_00000009").is_symlink() and _snapshot(other) == before


def test_portable_index_naming_a_file_outside_is_refused(tmp_path):
    """A portable checkpoint's index.json maps tensor names to its files: one naming another
    folder's safetensors file (which reads fine) is refused, naming the index."""
    import torch

    from megatron_rembert.checkpoint.files import SafetensorsWriter
    from megatron_rembert.checkpoint.portable import INDEX, PortableReader

    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    (tmp_path / "other").mkdir()
    with SafetensorsWriter(tmp_path / "other" / "model.safetensors",
                           [("w", weight.dtype, tuple(weight.shape))]) as writer:
        writer.write("w", weight)
    folder = tmp_path / "mine" / "step_00000002"
    folder.mkdir(parents=True)
    (folder / INDEX).write_text(json.dumps({"w": "../../other/model.safetensors"}))
    with PortableReader(folder) as reader, pytest.raises(CheckpointError, match="'..'") as caught:
        reader.full("w")
    assert str(caught.value).startswith(f"{folder / INDEX}: names '../../other/")
