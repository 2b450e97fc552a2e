"""Train at tp=2 x pp=2, reshard, continue: the losses of continuing without resharding."""

import pytest
import torch

from megatron_rembert.convert.__main__ import main
from tests.convert.tampering import copy_step
from tests.convert.workers import overrides, train_worker
from tests.distributed import run_distributed

pytestmark = pytest.mark.multiprocess  # every test here starts processes

TINY = {"preset": "tiny"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """3 steps at tp=2 x pp=2 (saved), then 3 more: the reference continuation."""
    root = tmp_path_factory.mktemp("reshard")
    save = root / "src"
    losses = run_distributed(train_worker, 4, TINY, overrides(2, 2), None, 0, 6,
                             (str(save), 3), timeout=400)[0]
    return save / "step_00000003", losses[3:]


@pytest.mark.parametrize("tp, pp, world", [(1, 1, 2), (3, 1, 3)])
def test_reshard_continues_exactly(trained, tmp_path, tp, pp, world):
    step_dir, expected = trained
    out = tmp_path / "resharded"
    assert main(["reshard", "--checkpoint", str(step_dir), "--out", str(out), "--tp", str(tp),
                 "--pp", str(pp)]) == 0
    losses = run_distributed(train_worker, world, TINY, overrides(tp, pp),
                             str(out / "step_00000003"), 3, 3, None, timeout=300)[0]
    print("resharded", tp, pp, losses, "reference", expected)
    assert losses == pytest.approx(expected, rel=1e-5)


def test_resume_at_another_layout_without_converting(trained):
    """The tp=2 x pp=2 x dp=1 checkpoint loaded directly at tp=1 x pp=1 x dp=2 (other
    fragments): the trainer reads its fragments, optimizer state included."""
    step_dir, expected = trained
    losses = run_distributed(train_worker, 2, TINY, overrides(1, 1), str(step_dir), 3, 3,
                             None, timeout=300)[0]
    assert losses == pytest.approx(expected, rel=1e-5)


def test_tampered_pipeline_files_are_refused(trained, tmp_path, capsys):
    """The optimizer shard files of a tp=2 x pp=2 run (the production path's only tensor
    files), checked fragment by fragment against meta.json's model before anything is written:
    an int8 master fragment in TP rank 1's file, and a meta.json that says fewer layers than
    the files hold."""
    step_dir, _ = trained
    shard = "optim_tp01_pp000_dp000.safetensors"

    def master_int8(data):
        key = next(k for k in data if k.startswith("master/") and "query.weight" in k)
        data[key] = data[key].to(torch.int8)

    for name, file, edit, model, expected in (
            ("int8", shard, master_int8, None, (f"{shard}: tensor ", " has dtype int8")),
            ("fewer_layers", None, None, {"num_hidden_layers": 1},
             ("_pp001_dp000.safetensors: tensor rembert.layers.1.",
              "is not a parameter of the model"))):
        bad = copy_step(step_dir, tmp_path / name, file, edit, model)
        assert main(["reshard", "--checkpoint", str(bad), "--out", str(tmp_path / "o"),
                     "--tp", "1", "--pp", "1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and all(e in err for e in expected), err
        assert not (tmp_path / "o").exists()


def test_reshard_lamb_state(tmp_path):
    """LAMB's moments and step count reshard like Adam's (same state names and shapes)."""
    lamb = ["optim.name=lamb"]
    save = tmp_path / "src"
    full = run_distributed(train_worker, 4, TINY, overrides(2, 2) + lamb, None, 0, 6,
                           (str(save), 3), timeout=400)[0]
    out = tmp_path / "resharded"
    assert main(["reshard", "--checkpoint", str(save / "step_00000003"), "--out", str(out),
                 "--tp", "1", "--pp", "1"]) == 0
    losses = run_distributed(train_worker, 2, TINY, overrides(1, 1) + lamb,
                             str(out / "step_00000003"), 3, 3, None, timeout=300)[0]
    assert losses == pytest.approx(full[3:], rel=1e-5)
