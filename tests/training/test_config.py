"""Config parsing, validation and the checks that run before any heavy work."""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_rembert.checkpoint import CheckpointError
from megatron_rembert.checkpoint.step_folder import find_latest
from megatron_rembert.config import ConfigError
from megatron_rembert.data.common import DataError
from megatron_rembert.run_config.checks import check_config, check_ranges
from megatron_rembert.run_config.help import config_help
from megatron_rembert.run_config.load import build_config, load_config
from megatron_rembert.run_config.schema import RANGES, SECTIONS, Config
from megatron_rembert.training.ds_config import deepspeed_config, load_ds_config
from megatron_rembert.training.inputs import check_inputs
from megatron_rembert.training.optim import lr_lambda
from megatron_rembert.training.plan import RunPlan
from tests.training.conftest import SEQ

ROOT = Path(__file__).resolve().parents[2]


def test_yaml_and_overrides():
    config = load_config(ROOT / "configs/tiny.yaml", ["train.steps=20", "parallel.tp=2",
                                                      "optim.lr=1e-3", "model.num_hidden_layers=4"])
    assert config.train.steps == 20 and config.parallel.tp == 2
    assert config.optim.lr == 1e-3 and isinstance(config.optim.lr, float)
    assert config.model.num_hidden_layers == 4 and config.model.hidden_size == 48  # preset kept


@pytest.mark.parametrize("item, message", [
    ("train.bogus=1", "unknown key train.bogus"),
    ("train.steps=abc", "train.steps: expected int"),
    ("train.steps=true", "train.steps: expected int"),
    ("nosection.x=1", "unknown config section"),
    ("steps=1", "expected SECTION.KEY"),
    ("train.steps", "expected KEY=VALUE"),
    ("model.preset=giant", "unknown model preset 'giant'"),
])
def test_bad_overrides_name_the_key(item, message):
    with pytest.raises(ConfigError, match=message):
        build_config({}, [item])


@pytest.mark.parametrize("sets, world, message", [
    (["parallel.tp=2", "parallel.pp=2"], 6, "world size 6 is not divisible"),
    (["parallel.tp=4"], 4, "num_attention_heads=6 is not divisible by parallel.tp=4"),
    (["parallel.pp=3"], 3, "num_hidden_layers=2 is fewer than parallel.pp=3"),
    (["parallel.zero_stage=2"], 2, "zero_stage=2: gradients are not sharded"),
    (["parallel.zero_stage=0"], 1, "zero_stage=0: every run shards the optimizer state"),
    (["parallel.zero_stage=3"], 1, "parallel.zero_stage=3"),
    (["train.global_batch_size=30"], 2, "global_batch_size=30 is not a multiple"),
    (["data.seq_length=4096"], 1, "exceeds model.max_position_embeddings"),
])
def test_layout_errors(sets, world, message):
    config = load_config(ROOT / "configs/tiny.yaml", sets)
    with pytest.raises(ConfigError, match=message):
        RunPlan.build(config, world)


def test_deepspeed_dict_gets_every_number_from_our_config(tmp_path):
    """The engine's dict: batch sizes from our config and the layout, the user's services
    kept, and everything that would touch the gradients off (our optimizer clips, reduces and
    keeps the precision)."""
    services = tmp_path / "services.json"
    services.write_text(json.dumps({"wall_clock_breakdown": True}))
    config = load_config(ROOT / "configs/rembert.yaml", [f"parallel.ds_config={services}"])
    ds = deepspeed_config(config, RunPlan.build(config, 32).layout,  # tp 2 x dp 16
                          load_ds_config(config))
    assert ds["train_batch_size"] == 2048 and ds["train_micro_batch_size_per_gpu"] == 16
    assert ds["gradient_accumulation_steps"] == 8 and ds["gradient_clipping"] == 0.0
    assert not ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["zero_optimization"] == {"stage": 0}
    assert ds["wall_clock_breakdown"] is True  # the JSON's own service kept
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_batch_size": 4}))
    config.parallel.ds_config = str(bad)
    with pytest.raises(ConfigError, match="sets train_batch_size, .* train.global_batch_size"):
        load_ds_config(config)


def test_lr_schedule_warmup_then_linear_decay():
    config = load_config(ROOT / "configs/rembert.yaml",
                         ["train.steps=100", "optim.warmup_steps=10"])
    f = lr_lambda(config)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.5) and f(100) == pytest.approx(0.0)


def _tiny(tiny_dataset, *sets):
    data, tok = tiny_dataset
    return load_config(ROOT / "configs/tiny.yaml", [f"data.path={data}",
                                                    f"data.tokenizer={tok}",
                                                    f"data.seq_length={SEQ}", *sets])


def test_inputs_accepted(tiny_dataset):
    plan, sha = check_inputs(_tiny(tiny_dataset), 2, torch.device("cpu"), rank=1)
    assert (plan.layout.dp, plan.layout.dp_rank) == (2, 1) and len(sha) == 64


def test_missing_data_folder(tiny_dataset, tmp_path):
    with pytest.raises(ConfigError, match="no manifest.json"):
        check_inputs(_tiny(tiny_dataset, f"data.path={tmp_path / 'nope'}"), 1,
                     torch.device("cpu"))


def test_other_tokenizer_is_refused(tiny_dataset, tmp_path):
    other = tmp_path / "other.model"
    other.write_bytes(tiny_dataset[1].read_bytes() + b"x")
    with pytest.raises(DataError, match="manifest.json: dataset made with tokenizer"):
        check_inputs(_tiny(tiny_dataset, f"data.tokenizer={other}"), 1, torch.device("cpu"))


def test_pickled_word_starts_is_refused_before_the_model_is_built(tiny_dataset, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_dataset[0], data)
    # An object array: np.save pickles it, and loading it would run the pickle's code.
    np.save(data / "word_starts.npy", np.array([print], dtype=object), allow_pickle=True)
    config = _tiny(tiny_dataset, f"data.path={data}", "data.whole_word_mask=true")
    with pytest.raises(DataError, match="word_starts.npy: not a plain .npy array"):
        check_inputs(config, 1, torch.device("cpu"))


def test_vocab_size_mismatch(tiny_dataset):
    with pytest.raises(ConfigError, match="set model.vocab_size=1000"):
        check_inputs(_tiny(tiny_dataset, "model.vocab_size=1200"), 1, torch.device("cpu"))


def test_sequence_length_mismatch(tiny_dataset):
    with pytest.raises(DataError, match="sequence length"):
        check_inputs(_tiny(tiny_dataset, "data.seq_length=64"), 1, torch.device("cpu"))


def test_latest_pointing_at_incomplete_checkpoint(tmp_path):
    (tmp_path / "step_00000005").mkdir()
    (tmp_path / "latest").write_text("step_00000005\n")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        find_latest(tmp_path)
    assert find_latest(tmp_path / "empty") is None


@pytest.mark.multiprocess
def test_cli_dry_run_and_errors():
    run = subprocess.run([sys.executable, "train.py", "--config", "configs/rembert.yaml",
                          "--dry-run", "--world-size", "64"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "993,263,548 parameters in pre-training" in run.stdout
    assert "pp 1 x dp 32 x tp 2" in run.stdout and "optimizer_states" in run.stdout
    bad = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.yaml",
                          "--set", "parallel.tp=4", "--dry-run"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "not divisible by parallel.tp=4" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT))
                                        for p in (ROOT / "configs").rglob("*.yaml")))
def test_every_shipped_config_loads_and_plans(path):
    from megatron_rembert.training.dry_run import dry_run_report

    config = load_config(ROOT / path)
    world = config.parallel.tp * config.parallel.pp * 2  # dp = 2
    report = dry_run_report(config, RunPlan.build(config, world))
    assert f"model {config.model_preset}:" in report and "total" in report


def test_every_setting_has_help_and_help_lists_every_key_with_it():
    """Each field of each section carries its help text in its metadata (config.setting), and
    --help prints every key with exactly that text, its default and its allowed values."""
    text = config_help().splitlines()
    default = Config()
    keys = 0
    for section in SECTIONS:
        values = getattr(default, section)
        for f in dataclasses.fields(values):
            key = f"{section}.{f.name}"
            assert isinstance(f.metadata.get("help"), str) and f.metadata["help"].strip(), key
            (line,) = [t for t in text if t.startswith(f"  {key} = ")]
            assert line.startswith(f"  {key} = {getattr(values, f.name)}")
            assert line.endswith(f"  ({f.metadata['help']})"), key
            keys += 1
    assert keys == len(text) - 2  # the heading and model.preset besides
    assert set(SECTIONS) == {"model", "parallel", "data", "optim", "train", "eval"}
    assert "  parallel.zero_stage = 1  [0, 2]  (1: the optimizer state" in config_help()
    assert "  data.mask_prob = 0.15  (0, 1)  (" in config_help()


def test_every_numeric_setting_has_a_range_checked_before_heavy_work():
    default = Config()
    for section in ("model", "parallel", "data", "optim", "train"):
        for f in dataclasses.fields(getattr(default, section)):
            if f.type in ("int", "float"):
                key = f"{section}.{f.name}"
                assert key in RANGES, f"{key} has no range"
                config = build_config({}, [f"{key}=.nan" if f.type == "float" else
                                           f"{key}=-1000000000000"])
                with pytest.raises(ConfigError, match=f"^{key}="):
                    check_ranges(config)


@pytest.mark.parametrize("sets, message", [
    (["data.phase_starts=[0.0, 0.6, 0.3]"], r"phases out of order \(0.6 then 0.3\)"),
    (["data.phase_starts=[0.1, 0.5]"], "the first phase must start at 0.0"),
    (["data.phase_starts=[0.0, 0.5]", "data.phase_mask_prob=[0.3, 1.2]"],
     r"data.phase_mask_prob=\[0.3, 1.2\]: 1.2 is not in \(0, 1\)"),
    (["data.phase_starts=[0.0, 0.5]", "data.phase_mask_prob=[0.3, 0.0]"], "0.0 is not in"),
    (["data.phase_starts=[0.0, 0.5]", "data.phase_alpha=[0.5]"],
     "data.phase_alpha has 1 values, data.phase_starts 2"),
    (["data.mask_schedule=cosine"], "expected step or linear"),
    (["data.language_start={sw: 1.0}"], r"data.language_start.sw=1.0: .* \[0, 1\)"),
    (["data.phase_starts=[0.0, 0.5]", "data.phase_mask_prob=[0.4, 0.15]",
      "data.max_predictions=80"], "max_predictions=80 is too small for the largest mask rate "
                                  "0.4: a full row masks 204 tokens"),
    (["optim.decay_start_step=5"], r"optim.decay_start_step=5: must be in \[optim.warmup_st"),
    (["data.phase_starts=0.5"], "data.phase_starts: expected a list"),
])
def test_bad_schedules_are_refused(sets, message):
    with pytest.raises(ConfigError, match=message):
        check_config(load_config(ROOT / "configs/rembert.yaml", sets))


def test_unknown_language_is_refused_at_start_up(tiny_dataset):
    with pytest.raises(ConfigError, match=r"data.language_start names \['sw'\], which .*"
                                          "does not have"):
        check_inputs(_tiny(tiny_dataset, "data.language_start={sw: 0.5}"), 1,
                     torch.device("cpu"))


def test_lr_warmup_stable_decay():
    sets = ["train.steps=100", "optim.warmup_steps=10", "optim.decay_start_step=60"]
    for decay, mid in (("linear", 0.5), ("cosine", 0.5), ("1-sqrt", 1 - 0.5 ** 0.5)):
        f = lr_lambda(load_config(ROOT / "configs/rembert.yaml", sets + [f"optim.decay={decay}"]))
        assert f(9) == pytest.approx(1.0) and f(35) == 1.0 and f(60) == 1.0
        assert f(80) == pytest.approx(mid) and f(100) == pytest.approx(0.0)


def test_larger_model_vocab_needs_allow_larger_vocab(tiny_dataset):
    with pytest.raises(ConfigError, match=r"data.allow_larger_vocab=true accepts"):
        check_inputs(_tiny(tiny_dataset, "model.vocab_size=1200"), 1, torch.device("cpu"))
    check_inputs(_tiny(tiny_dataset, "model.vocab_size=1200", "data.allow_larger_vocab=true"), 1,
                 torch.device("cpu"))
    # Never a smaller model vocabulary: the dataset's ids would index past it.
    with pytest.raises(ConfigError, match="set model.vocab_size=1000") as err:
        check_inputs(_tiny(tiny_dataset, "model.vocab_size=800", "data.allow_larger_vocab=true"),
                     1, torch.device("cpu"))
    assert "allow_larger_vocab" not in str(err.value)


def test_gloo_pipeline_on_gpus_is_refused(tiny_dataset):
    """Seen on an H200: DeepSpeed's pipeline send of a CUDA tensor through gloo aborts the
    process (gloo writes from the device pointer); refused before any work instead. Only the
    device's type is read: no GPU is needed."""
    config = _tiny(tiny_dataset, "parallel.pp=2", "parallel.backend=gloo")
    with pytest.raises(ConfigError, match="parallel.backend=gloo with parallel.pp>1 on GPUs"):
        check_inputs(config, 2, torch.device("cuda", 0))
    check_inputs(config, 2, torch.device("cpu"))  # gloo on CPUs is how the tests run
    check_inputs(_tiny(tiny_dataset, "parallel.pp=2"), 2, torch.device("cuda", 0))
