"""train.py with a save folder that leads elsewhere (issue 30): a `latest` or a step folder that
names another run's checkpoint is refused with one `error:` line naming `latest`, before
anything is trained or written; a link where this run saves is replaced, never written
through; stray entries are listed once and ignored at every save. Real processes: train.py
as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import free_port
from tests.training.production import as_sets, data_overrides

pytestmark = pytest.mark.multiprocess  # every test here starts train.py

ROOT = Path(__file__).resolve().parents[2]


def _train(tiny_dataset, out: Path, save_dir: Path, steps: int) -> subprocess.CompletedProcess:
    sets = {**data_overrides(*tiny_dataset, out, steps), "train.save_dir": save_dir,
            "train.save_interval": 2, "train.keep_last": 2}
    args = [a for s in as_sets(sets) for a in ("--set", s)]
    env = {**os.environ, "MASTER_PORT": str(free_port())}
    return subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.yaml", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b""
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def other_run(tiny_dataset, tmp_path_factory) -> Path:
    """Another run's save folder: complete checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("other_run")
    run = _train(tiny_dataset, root, root / "ckpt", 4)
    assert run.returncode == 0, run.stderr[-3000:]
    return root / "ckpt"


@pytest.mark.parametrize("how", ["absolute", "dotdot", "step-folder-link"])
def test_resume_refuses_a_checkpoint_outside_the_save_folder(how, tiny_dataset, other_run,
                                                             tmp_path):
    """`latest` holding another run's step folder by absolute path or `..`, or naming a step
    folder of this folder that is a symlink to another run's: the run would resume from the
    other run's weights and (through a link at a step it saves) overwrite its files."""
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    if how == "absolute":
        (save_dir / "latest").write_text(f"{other_run / 'step_00000002'}\n")
    elif how == "dotdot":
        os.symlink(other_run, tmp_path / "other")  # `..` reaches it from this folder
        (save_dir / "latest").write_text("../other/step_00000002\n")
    else:
        for step in ("step_00000002", "step_00000004"):
            os.symlink(other_run / step, save_dir / step)
        (save_dir / "latest").write_text("step_00000002\n")
    before, mine = _snapshot(other_run), sorted(os.listdir(save_dir))
    run = _train(tiny_dataset, tmp_path, save_dir, 4)
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert run.returncode == 2, run.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert f"{save_dir / 'latest'}: names" in errors[0], errors[0]
    assert "step " not in run.stdout  # nothing trained
    assert _snapshot(other_run) == before  # the other run's files untouched
    assert sorted(os.listdir(save_dir)) == mine  # nothing written here either


def test_save_replaces_a_link_and_lists_strays_once(tiny_dataset, other_run, tmp_path):
    """A fresh run whose save folder holds a link named like the step it saves (to another
    run's checkpoint), a copied `step_X.bak` and a stray file: it trains and saves twice; the
    link is replaced by its own folder (the other run's files untouched), the strays are named
    in one notice and left alone, never fatal at a save."""
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    os.symlink(other_run / "step_00000002", save_dir / "step_00000002")
    (save_dir / "step_00000001.bak").mkdir()
    (save_dir / "step_00000001.bak" / "complete").write_text("")
    (save_dir / "notes.txt").write_text("mine\n")
    before = _snapshot(other_run)
    run = _train(tiny_dataset, tmp_path, save_dir, 4)
    assert run.returncode == 0, run.stderr[-3000:]
    notices = [line for line in run.stdout.splitlines() if "not checkpoints of this run" in line]
    assert len(notices) == 1, run.stdout
    assert all(name in notices[0] for name in ("notes.txt", "step_00000001.bak/",
                                               "step_00000002")), notices[0]
    assert _snapshot(other_run) == before
    for step in ("step_00000002", "step_00000004"):
        folder = save_dir / step
        assert folder.is_dir() and not folder.is_symlink() and (folder / "complete").exists()
    assert (save_dir / "latest").read_text().strip() == "step_00000004"
    assert (save_dir / "notes.txt").read_text() == "mine\n"
    assert (save_dir / "step_00000001.bak" / "complete").exists()


def test_training_refuses_a_dataset_naming_a_shard_elsewhere(tiny_dataset, tmp_path):
    """data.path's manifest naming a shard by an absolute path to an exact copy elsewhere (its
    size, schema and sha256 all match): train.py refuses before training, naming the manifest."""
    data = tmp_path / "data"
    shutil.copytree(tiny_dataset[0], data)
    manifest = json.loads((data / "manifest.json").read_text())
    entry = next(s for s in manifest["shards"] if s["split"] == "train")
    elsewhere = tmp_path / "elsewhere.arrow"
    shutil.copyfile(data / entry["file"], elsewhere)
    entry["file"] = str(elsewhere)
    (data / "manifest.json").write_text(json.dumps(manifest))
    run = _train((data, tiny_dataset[1]), tmp_path, tmp_path / "ckpt", 2)
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert run.returncode == 2, run.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert f"{data / 'manifest.json'}: names '{elsewhere}', an absolute path" in errors[0]
    assert "step " not in run.stdout and not list((tmp_path / "ckpt").glob("step_*"))
