"""A checkpoint trained by the trainer at tp 2 (the production path's files: each rank's
optimizer shard, whose fp32 masters are the weights) and its `rembert-convert to-hf` export
give the same figures."""

from pathlib import Path

import pytest

from tests.distributed import run_distributed
from tests.eval.test_command import _figures, run, run_command

pytestmark = pytest.mark.multiprocess  # trains on 2 gloo ranks

ROOT = Path(__file__).resolve().parents[2]


def _train(rank, world_size, sets):
    from megatron_rembert.run_config.load import load_config
    from megatron_rembert.training import loop

    return loop.train(load_config(str(ROOT / "configs" / "tiny.yaml"), sets))["step"]


@pytest.mark.parametrize("tied", [False, True])
def test_tp2_checkpoint_and_its_hf_export_agree(tmp_path, corpus_and_tokenizer, parallel,
                                                capsys, tied):
    """tied: a coupled model (E_in = E_out, one table, saved once). Untied, the command also
    runs in its own process, where reading the checkpoint prints no "Setting accelerator to
    CPU" warning."""
    pytest.importorskip("tokenizers")
    from megatron_rembert.convert.__main__ import main as convert
    from megatron_rembert.prep.preprocess import PreprocessConfig, preprocess
    from tests.eval.sets import classification

    corpus, tokenizer = corpus_and_tokenizer
    preprocess(PreprocessConfig(str(corpus), str(tmp_path / "data"), str(tokenizer),
                                seq_length=32, workers=1, valid_fraction=0.05, progress=False))
    sets = {"data.path": tmp_path / "data", "data.tokenizer": tokenizer,
            "data.seq_length": 32, "data.num_workers": 0, "parallel.tp": 2,
            "train.steps": 3, "train.global_batch_size": 4, "train.micro_batch_size": 2,
            "train.eval_interval": 0, "train.save_interval": 0, "optim.warmup_steps": 1,
            "train.save_dir": tmp_path / "ckpt", "train.log_dir": tmp_path / "logs"}
    if tied:
        sets |= {"model.tie_embeddings": "true", "model.output_embedding_size": 16}
    steps = run_distributed(_train, 2, [f"{k}={v}" for k, v in sets.items()], timeout=400)
    assert steps == [3, 3]
    folder = tmp_path / "ckpt" / "step_00000003"
    assert sorted(p.name for p in folder.glob("*.safetensors")) == [
        "optim_tp00_pp000_dp000.safetensors", "optim_tp01_pp000_dp000.safetensors"]
    assert not list(folder.glob("*model_states.pt"))
    train, test = classification(tmp_path / "cls", corpus, False, 40, 20)
    args = ["--parallel", str(parallel), "--classify-train", str(train), "--classify-test",
            str(test), "--seeds", "1", "--epochs", "1", "--lr", "1e-3"]
    ours = run(["--checkpoint", str(tmp_path / "ckpt"), *args], tmp_path, capsys)
    if not tied:  # the command itself, reading the checkpoint: no accelerator warning
        done = run_command(["--checkpoint", str(tmp_path / "ckpt"), "--parallel",
                            str(parallel), "--skip-classify", "--quiet"], tmp_path)
        assert done.returncode == 0 and "Retrieval accuracy@1" in done.stdout, done.stderr
        assert "Setting accelerator" not in done.stderr + done.stdout, done.stderr
    assert ours["model"]["step"] == 3 and ours["retrieval"]["layer"] == 1  # tiny: 2 layers
    assert convert(["to-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out",
                    str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    theirs = run(["--hf", str(tmp_path / "hf"), *args], tmp_path, capsys)
    a, b = _figures(ours), _figures(theirs)
    assert sorted(a) == sorted(b) and len(a) > 20
    for key, value in a.items():
        assert b[key] == pytest.approx(value, abs=1e-6), key
    assert ours["retrieval"]["languages"]["same"]["model"] == {"to_en": 1.0, "from_en": 1.0}
