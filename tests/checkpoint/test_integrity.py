"""Integrity of the trainer's checkpoints: hashed at save, verified before any unpickling,
pickles that carry code never run, old checkpoints (no manifest) still load, and a save that
fails or would store non-finite weights leaves `latest` on the last good checkpoint."""

import json
import shutil

import pytest

from megatron_rembert.convert.__main__ import main
from megatron_rembert.fs import sha256_file
from tests.checkpoint.workers import OPTIM_FILE, integrity_worker
from tests.distributed import run_distributed

pytestmark = pytest.mark.multiprocess  # every test here starts processes


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    return root, run_distributed(integrity_worker, 1, str(root), timeout=300)[0]


def test_manifest_lists_every_file_as_saved(damaged):
    root, out = damaged
    folder = root / "run" / "step_00000001"
    files = json.loads((folder / "manifest.json").read_text())["files"]
    on_disk = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                     if p.is_file() and p.name not in ("manifest.json", "complete"))
    assert sorted(files) == on_disk
    # the production path's folder: our optimizer shard, the RNG states, no DeepSpeed file
    assert sorted(files) == ["meta.json", OPTIM_FILE, "rng/rank_00000.pt"], files
    for name, record in files.items():
        assert record == {"size": (folder / name).stat().st_size,
                          "sha256": sha256_file(folder / name)}, name


def test_code_carrying_pickles_never_run(damaged):
    root, out = damaged
    # the hash refuses a replaced file first; with a manifest made to agree, the guarded load
    assert f"{OPTIM_FILE}: " in out["new_evil_optim"]
    assert "manifest.json" in out["new_evil_optim"]
    assert "rank_00000.pt: refused to load" in out["new_evil_rng"], out["new_evil_rng"]
    # a checkpoint of DeepSpeed's files: one error saying how to convert it, nothing opened
    assert "step_00000001: a checkpoint of DeepSpeed's files" in out["legacy"], out["legacy"]
    assert "rembert-convert reshard" in out["legacy"]
    assert not list(root.glob("*.ran"))  # nothing ran


def test_failed_or_non_finite_save_keeps_last_good(damaged):
    root, out = damaged
    # torch's RuntimeError for a full disk, said as one line naming the step folder
    assert "step_00000002: saving failed on 1 rank(s) (" in out["full_disk"]
    assert "PytorchStreamWriter failed writing file data/0" in out["full_disk"]
    assert "non-finite" in out["non_finite"] or "inf or NaN" in out["non_finite"]
    save_dir = root / "run"
    assert (save_dir / "latest").read_text().strip() == "step_00000001"
    assert sorted(p.name for p in save_dir.glob("step_*")) == ["step_00000001"]
    for message in out.values():
        assert "\n" not in str(message)


def test_flipped_optimizer_bytes_refused_by_reshard(damaged, tmp_path, capsys):
    root, _ = damaged
    step = tmp_path / "run" / "step_00000001"
    shutil.copytree(root / "run" / "step_00000001", step)
    optim = step / OPTIM_FILE
    data = bytearray(optim.read_bytes())
    data[len(data) // 2] ^= 0x01
    optim.write_bytes(bytes(data))
    assert main(["reshard", "--checkpoint", str(step), "--out", str(tmp_path / "r"),
                 "--tp", "1", "--pp", "1"]) == 2
    assert f"{OPTIM_FILE}: sha256 differs" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    # --out on the run's own save folder: refused before anything is replaced.
    assert main(["reshard", "--checkpoint", str(root / "run" / "step_00000001"), "--out",
                 str(root / "run"), "--tp", "1", "--pp", "1", "--force"]) == 2
    assert "own save folder" in capsys.readouterr().err
    assert (root / "run" / "step_00000001" / "complete").exists()
