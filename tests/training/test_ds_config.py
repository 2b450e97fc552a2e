"""A user's DeepSpeed JSON (training/ds_config.py) holds only what takes effect: a key our
config owns is refused naming ours; a key that does nothing on our gradient path is refused
naming what does its job; an unknown key is refused; fp16's loss-scale keys reach our scaler
(and only in fp16). `train.py --dry-run` reads and checks it, one `error:` line each."""

import json
from pathlib import Path

import pytest

from megatron_rembert import train
from megatron_rembert.config import ConfigError
from megatron_rembert.run_config.load import load_config
from megatron_rembert.training import data_parallel
from megatron_rembert.training.ds_config import APPLIED, OWNED, REFUSED, load_ds_config

ROOT = Path(__file__).resolve().parents[2]


def _nested(dotted: str, value) -> dict:
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


def _config(path: Path, precision: str = "bf16"):
    return load_config(ROOT / "configs/tiny.yaml", [f"parallel.ds_config={path}",
                                                     f"train.precision={precision}"])


@pytest.mark.parametrize("key", sorted(OWNED))
def test_owned_key_refused_naming_ours(key, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"wall_clock_breakdown": False, **_nested(key, 2)}))
    with pytest.raises(ConfigError) as err:
        load_ds_config(_config(path, "fp16" if key.startswith("fp16") else "bf16"))
    assert f"sets {key}," in str(err.value) and OWNED[key] in str(err.value)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_a_key_that_does_nothing_is_refused_naming_what_does_its_job(key, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_nested(key, 2)))
    with pytest.raises(ConfigError) as err:
        load_ds_config(_config(path))
    message = str(err.value)
    assert f"sets {key}, which does nothing on this trainer's gradient path" in message
    assert REFUSED[key] in message and str(path) in message


def test_unknown_keys_and_fp16_outside_fp16_are_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size": 4}))  # a typo of DeepSpeed's key
    with pytest.raises(ConfigError, match="sets train_micro_batch_size, which this trainer "
                                          "does not know to take effect"):
        load_ds_config(_config(path))
    path.write_text(json.dumps({"fp16": {"loss_scale_window": 100}}))
    with pytest.raises(ConfigError, match="sets fp16, which does nothing with "
                                          "train.precision=bf16"):
        load_ds_config(_config(path))


def test_every_shipped_key_takes_effect():
    """Each shipped JSON's keys are services DeepSpeed runs or fp16 settings our scaler
    applies: the scaler built from it has the JSON's numbers."""
    shipped = sorted((ROOT / "ds_configs").glob("*.json"))
    assert shipped
    for path in shipped:
        ds = json.loads(path.read_text())
        assert set(ds) <= set(APPLIED), path
        config = _config(path, "fp16" if "fp16" in ds else "bf16")
        user = load_ds_config(config)
        assert user == ds
        if "fp16" in ds:
            scaler = data_parallel.loss_scaler(user, config)
            fp16 = ds["fp16"]
            assert scaler.cur_scale == 2.0 ** fp16["initial_scale_power"]
            assert scaler.scale_window == fp16["loss_scale_window"]
            assert scaler.hysteresis == fp16["hysteresis"]
            assert scaler.min_scale == fp16["min_loss_scale"]
            assert scaler.dynamic == (fp16["loss_scale"] == 0)


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{\"zero_optimization\": {", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"zero_optimization": {"stage": 2}}), "sets zero_optimization.stage,"),
    (json.dumps({"zero_optimization": {"reduce_bucket_size": 5}}),
     "sets zero_optimization.reduce_bucket_size, which does nothing"),
])
def test_dry_run_checks_the_ds_config(content, message, tmp_path, capsys):
    path = tmp_path / "ds.json"
    if content is not None:
        path.write_text(content)
    code = train.main(["--config", str(ROOT / "configs/tiny.yaml"), "--dry-run",
                       "--set", f"parallel.ds_config={path}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: parallel.ds_config=") and message in err
    assert str(path) in err and len(err.strip().splitlines()) == 1
