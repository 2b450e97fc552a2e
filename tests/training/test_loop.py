"""train(): resume after a signal or a kill equals an uninterrupted run; failures are clean.

The runs here train under every schedule at once (SCHEDULES): the mask rate falls linearly
through phase 0 and the language mix changes at step 3, where one language enters too; the
learning rate decays (1-sqrt) from step 4. The signal stops a run at step 2, so resuming crosses
every boundary; the one-process run after a kill reproduces the two-process run."""

import json
import math
import os
import shutil
import signal
import socket
import zipfile
from pathlib import Path

import pytest

from tests.distributed import run_distributed
from tests.training.conftest import SEQ

pytestmark = pytest.mark.multiprocess  # every test here starts processes

STEPS = 6
SCHEDULES = {"data.phase_starts": [0.0, 0.5], "data.phase_alpha": [1.0, 0.3],
             "data.phase_mask_prob": [0.3, 0.1], "data.mask_schedule": "linear",
             "data.language_start": {"hang": 0.5}, "optim.decay": "1-sqrt",
             "optim.decay_start_step": 4}


def overrides(tmp: Path, data, tokenizer, **extra) -> list[str]:
    values = {**SCHEDULES,
        "data.path": data, "data.tokenizer": tokenizer, "data.seq_length": SEQ,
        "data.num_workers": 0, "train.steps": STEPS, "train.global_batch_size": 8,
        "train.micro_batch_size": 2, "train.log_interval": 1, "train.eval_interval": 3,
        "train.eval_batches": 1, "train.save_interval": 0, "optim.warmup_steps": 2,
        "train.save_dir": tmp / "ckpt", "train.log_dir": tmp / "logs",
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def rows(log_dir: Path, split: str = "train") -> dict[int, dict]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["split"] == split}


def losses(log_dir: Path, split: str = "train") -> dict[int, float]:
    return {step: r["loss"] for step, r in rows(log_dir, split).items()}


def _train(rank, world_size, sets, signal_at=None, die_saving_step=None, nan_from=None):
    """Run train() from configs/tiny.yaml; optional faults injected from the outside."""
    from megatron_rembert.run_config.load import load_config
    from megatron_rembert.training import checkpoint, engine, loop

    real_step = engine.Trainer.train_step
    calls = {"n": 0}

    def step(self, batches):
        stats = real_step(self, batches)
        calls["n"] += 1
        if signal_at is not None and calls["n"] == signal_at and rank == world_size - 1:
            os.kill(os.getpid(), signal.SIGTERM)  # only one rank is told; all must stop
        if nan_from is not None and calls["n"] >= nan_from:
            stats.loss = float("nan")
        return stats

    engine.Trainer.train_step = step
    if die_saving_step is not None:
        real_save = checkpoint.torch.save

        def save(obj, path, *args, **kwargs):
            if f"step_{die_saving_step:08d}" in str(getattr(path, "name", path)):
                os._exit(137)  # as if killed -9 after the engine files, before 'complete'
            return real_save(obj, path, *args, **kwargs)

        checkpoint.torch.save = save
    config = load_config("configs/tiny.yaml", sets)
    return loop.train(config)["step"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_dataset):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    run_distributed(_train, 2, overrides(tmp, *tiny_dataset))
    result = losses(tmp / "logs")
    assert sorted(result) == list(range(1, STEPS + 1))
    row = json.loads((tmp / "logs" / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("step", "loss", "mlm_acc", "lr", "grad_norm", "loss_scale", "tokens_per_s",
                "tflops_per_gpu", "memory", "consumed_samples"):
        assert key in row, key
    assert "mfu" not in row  # no peak FLOP/s on CPU
    assert row["consumed_samples"] == 8 and row["lr"] > 0
    assert list((tmp / "logs").glob("events.out.tfevents.*"))  # TensorBoard
    valid = rows(tmp / "logs", "valid")
    assert sorted(valid) == [3, 6]  # validation at steps 3 and 6
    for row in valid.values():
        # every language of the dataset, each on the same fixed set; the overall numbers
        # combine the per-language ones
        languages = row["languages"]
        assert len(languages) == 8 and all(v["masked_tokens"] > 0 for v in languages.values())
        tokens = sum(v["masked_tokens"] for v in languages.values())
        assert row["masked_tokens"] == tokens
        assert row["loss"] == pytest.approx(
            sum(v["loss"] * v["masked_tokens"] for v in languages.values()) / tokens)
        assert row["loss_lang_avg"] == pytest.approx(
            sum(v["loss"] for v in languages.values()) / 8)
        assert row["mlm_acc_lang_avg"] == pytest.approx(
            sum(v["mlm_acc"] for v in languages.values()) / 8)
    assert ({k: v["masked_tokens"] for k, v in valid[3]["languages"].items()}
            == {k: v["masked_tokens"] for k, v in valid[6]["languages"].items()})
    return result, valid, tmp / "ckpt"


@pytest.mark.parametrize("background", [False, True], ids=["save", "background-save"])
def test_signal_saves_and_resume_matches(tmp_path, tiny_dataset, uninterrupted, background):
    """A signal at step 2 (with train.async_save the stop waits for the background write):
    `latest` names step 2 when the run has exited, and the resumed run equals the
    uninterrupted one."""
    uninterrupted, _, _ = uninterrupted
    sets = overrides(tmp_path, *tiny_dataset, **{"train.async_save": background})
    stopped = run_distributed(_train, 2, sets, 2)
    assert stopped == [2, 2]  # both ranks stopped at the step after the signal
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000002"
    run_distributed(_train, 2, sets)
    resumed = losses(tmp_path / "logs")
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step, loss in uninterrupted.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-6), f"step {step}"


@pytest.mark.parametrize("background", [False, True], ids=["save", "background-save"])
def test_kill_during_save_keeps_previous_checkpoint(tmp_path, tiny_dataset, uninterrupted,
                                                    background):
    """Killed while writing step 4's files (train.async_save: in the writer thread, after
    training went on): `latest` still names step 2, and the rerun continues from it."""
    uninterrupted, uninterrupted_valid, _ = uninterrupted
    sets = overrides(tmp_path, *tiny_dataset, **{"train.save_interval": 2,
                                                  "train.async_save": background})
    with pytest.raises(AssertionError, match="hung or died"):
        run_distributed(_train, 1, sets, None, 4, timeout=120)
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "step_00000002"
    assert not (ckpt / "step_00000004" / "complete").exists()
    run_distributed(_train, 1, sets)
    resumed = losses(tmp_path / "logs")
    assert (ckpt / "latest").read_text().strip() == f"step_{STEPS:08d}"
    # One process sees the same global batches as two: the losses of the 2-rank run, and
    # the same validation set, language by language.
    for step in range(3, STEPS + 1):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-6), f"step {step}"
    one = rows(tmp_path / "logs", "valid")[STEPS]["languages"]
    two = uninterrupted_valid[STEPS]["languages"]
    assert one.keys() == two.keys()
    for lang, numbers in two.items():
        assert one[lang]["masked_tokens"] == numbers["masked_tokens"], lang
        assert one[lang]["loss"] == pytest.approx(numbers["loss"], rel=1e-6), lang


def _pt_contents(folder: Path) -> dict[str, dict[str, bytes]]:
    """Every .pt file's zip records (torch.save's pickle and storages), less the id torch
    draws for each save (`.data/serialization_id`), and every .safetensors file's bytes (the
    optimizer's shard files)."""
    pt = {str(path.relative_to(folder)): {name: archive.read(name)
                                          for name in archive.namelist()
                                          if not name.endswith("serialization_id")}
          for path in sorted(folder.rglob("*.pt"))
          for archive in [zipfile.ZipFile(path)]}
    return {**pt, **{str(path.relative_to(folder)): {"bytes": path.read_bytes()}
                     for path in sorted(folder.rglob("*.safetensors"))}}


BF16 = {"train.precision": "bf16"}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_background_saves_write_what_a_save_writes(tmp_path, tiny_dataset, uninterrupted,
                                                    precision):
    """train.async_save at 2 ranks, saving every 2 steps: the same losses as the run that
    saved only at the end in the foreground, and its last checkpoint's files byte for byte
    those that run wrote; every kept step complete, `latest` the last. fp32 (tiny.yaml), and
    bf16 (the production setting)."""
    if precision == "fp32":
        expected, _, foreground = uninterrupted
    else:
        foreground = tmp_path / "foreground"
        run_distributed(_train, 2, overrides(foreground, *tiny_dataset, **BF16))
        expected, foreground = losses(foreground / "logs"), foreground / "ckpt"
    extra = BF16 if precision == "bf16" else {}
    sets = overrides(tmp_path, *tiny_dataset, **{**extra, "train.save_interval": 2,
                                                  "train.async_save": True})
    assert run_distributed(_train, 2, sets) == [STEPS, STEPS]
    assert losses(tmp_path / "logs") == expected
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text().strip() == f"step_{STEPS:08d}"
    last = f"step_{STEPS:08d}"
    kept = sorted(ckpt.glob("step_*"))
    assert kept[-1].name == last and all((folder / "complete").exists() for folder in kept)
    contents = _pt_contents(ckpt / last)
    assert len(contents) == 4  # 2 ranks' optimizer shards and RNG states (no DeepSpeed file)
    assert contents == _pt_contents(foreground / last)


def test_non_finite_losses_stop_and_keep_last_good(tmp_path, tiny_dataset):
    """The first applied step with a non-finite loss stops the run (max_nonfinite_steps
    counts only steps whose update was skipped)."""
    sets = overrides(tmp_path, *tiny_dataset, **{"train.save_interval": 1,
                                                  "train.max_nonfinite_steps": 2})
    with pytest.raises(AssertionError, match="step 3: the loss is nan and the update was "
                                             "applied; the last good step is 2; stopping.*"
                                             "latest still names step_00000002"):
        run_distributed(_train, 1, sets, None, None, 3)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000002"
    assert not (tmp_path / "ckpt" / "step_00000003").exists()


def test_lamb_resume_matches_uninterrupted(tmp_path, tiny_dataset):
    """LAMB's state (moments and step count of ZeRO's flat partitions) survives a restart."""
    straight = tmp_path / "straight"
    run_distributed(_train, 2, overrides(straight, *tiny_dataset, **{"optim.name": "lamb"}))
    expected = losses(straight / "logs")
    sets = overrides(tmp_path, *tiny_dataset, **{"optim.name": "lamb"})
    assert run_distributed(_train, 2, sets, 3) == [3, 3]
    run_distributed(_train, 2, sets)
    resumed = losses(tmp_path / "logs")
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step, loss in expected.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-6), f"step {step}"


def test_resume_refuses_other_owner_and_data_then_continues_at_another_dp_and_batch(
        tmp_path, tiny_dataset, uninterrupted, capsys):
    """Saved by 2 ranks at step 6 (48 samples): a live lock holder, another dataset (same
    tokenizer) and another tokenizer are refused in one line; one rank (dp 2 -> 1) then
    continues directly with a global batch of 10 (48 is no multiple: the data skips to sample
    50) and train.steps 6 -> 8 (the 1-sqrt decay reshaped), each said in a notice."""
    from megatron_rembert.checkpoint import CheckpointError
    from megatron_rembert.launch_env import LaunchEnv
    from megatron_rembert.run_config.load import load_config
    from megatron_rembert.training.plan import RunPlan
    from megatron_rembert.training.save_dir import find_resume, run_meta, save_dir_locked

    _, _, saved = uninterrupted
    shutil.copytree(saved, tmp_path / "ckpt")
    data, tokenizer = tiny_dataset
    sets = overrides(tmp_path, data, tokenizer, **{"train.steps": STEPS + 2,
                                                   "train.global_batch_size": 10})
    lock = tmp_path / "ckpt" / ".lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    with pytest.raises(CheckpointError, match=rf"is in use by pid {os.getpid()}"):
        with save_dir_locked(load_config("configs/tiny.yaml", sets), LaunchEnv()):
            pass  # what train() does first
    lock.unlink()
    other = tmp_path / "other_data"
    shutil.copytree(data, other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps(manifest, indent=3))  # another file
    config = load_config("configs/tiny.yaml", overrides(tmp_path, other, tokenizer))
    plan = RunPlan.build(config, 1)
    layout = plan.layout
    meta = run_meta(config, "0" * 64, plan)
    with pytest.raises(CheckpointError, match=r"tokenizer_sha256 .*data.tokenizer="):
        find_resume(config, meta, layout)
    meta["tokenizer_sha256"] = json.loads(
        (tmp_path / "ckpt" / "step_00000006" / "meta.json").read_text())["tokenizer_sha256"]
    with pytest.raises(CheckpointError, match=rf"dataset_sha256 .*data.path={other}"):
        find_resume(config, meta, layout)
    config = load_config("configs/tiny.yaml", sets)
    layout = RunPlan.build(config, 1).layout
    meta = json.loads((tmp_path / "ckpt" / "step_00000006" / "meta.json").read_text())
    folder, _ = find_resume(config, {**meta, "config": config.to_dict()}, layout)
    notices = capsys.readouterr().out
    assert ("train.global_batch_size 8 -> 10; 48 samples consumed in 6 steps, 48 is not a "
            "multiple of 10: the data continues at sample 50, skipping 2 samples") in notices
    assert ("the LR schedule changes shape (train.steps 6 -> 8); step 7 trains at the "
            "checkpoint's LR 0, step 8 at 0.0002679 and") in notices
    assert run_distributed(_train, 1, sets) == [STEPS + 2]
    resumed = rows(tmp_path / "logs")
    assert sorted(resumed) == [STEPS + 1, STEPS + 2]
    assert [r["consumed_samples"] for r in resumed.values()] == [60, 70]
    assert [r["lr"] for r in resumed.values()] == pytest.approx([0, 2.679e-4], rel=1e-3)
    assert all(math.isfinite(r["loss"]) for r in resumed.values())
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"step_{STEPS + 2:08d}"


def test_resume_from_rolls_back_without_losing_newer(tmp_path, tiny_dataset, uninterrupted):
    """train.resume_from names an older folder: newer ones are moved aside, none deleted."""
    from megatron_rembert.run_config.load import load_config
    from megatron_rembert.training.plan import RunPlan
    from megatron_rembert.training.save_dir import find_resume

    _, _, saved = uninterrupted
    save_dir = tmp_path / "ckpt"
    shutil.copytree(saved / "step_00000006", save_dir / "step_00000003")  # stands in for 3
    meta = json.loads((save_dir / "step_00000003" / "meta.json").read_text())
    shutil.copytree(saved, save_dir, dirs_exist_ok=True)
    config = load_config("configs/tiny.yaml", overrides(
        tmp_path, *tiny_dataset, **{"train.resume_from": save_dir / "step_00000003"}))
    folder, how = find_resume(config, meta,
                              RunPlan.build(config, meta["layout"]["dp"]).layout)
    assert folder.path.name == "step_00000003" and how == "same"
    assert (save_dir / "latest").read_text().strip() == "step_00000003"
    assert [p.name for p in save_dir.glob("rolled_back/*/step_*")] == ["step_00000006"]
