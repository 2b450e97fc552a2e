"""A dataset is one folder (issue 30): a manifest naming a shard outside it (`..`, an absolute
path, a symlink leading out) is refused with one `error:` line naming the manifest, whoever
reads it (training's ShardDataset, merge, inspect), and a merge never writes outside --out."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from megatron_rembert.data.common import DataError
from megatron_rembert.data.shards import ShardDataset
from megatron_rembert.prep import commands
from megatron_rembert.prep.preprocess import preprocess
from tests.data.conftest import small_config


def _copy(dataset: Path, to: Path) -> Path:
    shutil.copytree(dataset, to, symlinks=True)
    return to


def _rename_shard(folder: Path, name_of) -> tuple[str, str]:
    """Give the manifest's first train shard the name `name_of(old name)`; returns both."""
    manifest = json.loads((folder / "manifest.json").read_text())
    entry = next(s for s in manifest["shards"] if s["split"] == "train")
    old, entry["file"] = entry["file"], name_of(entry["file"])
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return old, entry["file"]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b""
            for p in sorted(folder.rglob("*"))}


def _one_error(capsys, names: str) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert names in errors[0], errors[0]
    return errors[0]


def test_merge_never_writes_outside_out(dataset, tmp_path, capsys):
    """A part whose manifest names a shard `../../victim/...`: the merge would hard-link (or
    copy) the part's shard over the file that name reaches from --out."""
    part = _copy(dataset, tmp_path / "parts" / "p1")
    out = tmp_path / "a" / "b" / "out"
    old, _ = _rename_shard(part, lambda name: "../../victim/x.arrow")
    (tmp_path / "victim").mkdir()  # what the name reaches from the part: the shard's bytes
    shutil.copyfile(part / old, tmp_path / "victim" / "x.arrow")
    victim = tmp_path / "a" / "victim" / "x.arrow"  # what it reaches from --out
    victim.parent.mkdir(parents=True)
    victim.write_bytes(b"another dataset's file")
    code = commands.merge_datasets([str(part), "--out", str(out)])
    assert code == 2
    _one_error(capsys, f"{part / 'manifest.json'}: names '../../victim/x.arrow'")
    assert victim.read_bytes() == b"another dataset's file"
    assert not (out / "manifest.json").exists()


def test_merge_does_not_write_through_a_link_in_out(dataset, tmp_path, capsys):
    """--out holding a link where a language's shards go: refused, the link's target kept."""
    part = _copy(dataset, tmp_path / "part")
    lang = json.loads((part / "manifest.json").read_text())["shards"][0]["file"].split("/")[1]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out" / "train").mkdir(parents=True)
    os.symlink(elsewhere, tmp_path / "out" / "train" / lang)
    assert commands.merge_datasets([str(part), "--out", str(tmp_path / "out")]) == 2
    _one_error(capsys, f"{part / 'manifest.json'}: names 'train/{lang}/")
    assert not list(elsewhere.iterdir())


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_training_refuses_a_shard_outside_the_dataset(how, dataset, tmp_path):
    """The shard is an exact copy elsewhere (size, hash and schema all match): only where it
    lies tells it is not this dataset's."""
    folder = _copy(dataset, tmp_path / "ds")
    manifest = json.loads((folder / "manifest.json").read_text())
    name = next(s for s in manifest["shards"] if s["split"] == "train")["file"]
    elsewhere = tmp_path / "elsewhere" / "x.arrow"
    elsewhere.parent.mkdir()
    shutil.copyfile(folder / name, elsewhere)
    if how == "absolute":
        _rename_shard(folder, lambda _: str(elsewhere))
    elif how == "dotdot":
        _rename_shard(folder, lambda _: "../elsewhere/x.arrow")
    else:
        (folder / name).unlink()
        os.symlink(elsewhere, folder / name)
    with pytest.raises(DataError, match="must stay inside") as caught:
        ShardDataset(folder, "train", verify_checksums=True)
    assert str(caught.value).startswith(f"{folder / 'manifest.json'}: names")


def test_a_symlinked_shard_inside_the_dataset_is_read(dataset, tmp_path):
    """Links that stay inside the folder are no escape: the dataset reads as before."""
    folder = _copy(dataset, tmp_path / "ds")
    manifest = json.loads((folder / "manifest.json").read_text())
    name = next(s for s in manifest["shards"] if s["split"] == "train")["file"]
    (folder / name).rename(folder / "moved.arrow")
    os.symlink(folder / "moved.arrow", folder / name)
    reference = ShardDataset(dataset, "train")
    linked = ShardDataset(folder, "train", verify_checksums=True)
    assert [r.tolist() for _, r in linked.iter_rows()] == \
        [r.tolist() for _, r in reference.iter_rows()]


def test_inspect_refuses_a_shard_outside_the_dataset(dataset, tmp_path, capsys):
    folder = _copy(dataset, tmp_path / "ds")
    _rename_shard(folder, lambda name: "../" + name)
    assert commands.inspect_shards([str(folder), "--verify"]) == 2
    _one_error(capsys, f"{folder / 'manifest.json'}: names '../")


def test_preprocess_refuses_progress_naming_a_file_outside(corpus, tokenizer, dataset, tmp_path):
    """The progress record names the arrays file it loads and later deletes: a name leading
    out is refused before anything is read or removed."""
    folder = _copy(dataset, tmp_path / "ds")
    lang = json.loads((folder / "manifest.json").read_text())["shards"][0]["language"]
    record = folder / ".progress" / f"{lang}.json"
    victim = tmp_path / "victim.npz"
    victim.write_bytes(b"not ours")
    state = json.loads(record.read_text())
    state["arrays"] = "../../victim.npz"
    record.write_text(json.dumps(state))
    before = _snapshot(folder)
    with pytest.raises(DataError, match="must stay inside") as caught:
        preprocess(small_config(corpus, folder, tokenizer))
    assert str(caught.value).startswith(f"{record}: names '../../victim.npz'")
    assert victim.read_bytes() == b"not ours" and _snapshot(folder) == before
