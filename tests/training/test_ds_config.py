"""A user's DeepSpeed JSON may only add DeepSpeed knobs: a key our config owns is refused
(naming the key and ours), never overwritten; `train.py --dry-run` reads and checks it."""

import json
from pathlib import Path

import pytest

from megatron_rembert import train
from megatron_rembert.config import ConfigError
from megatron_rembert.training.optim import OWNED_DS_KEYS, load_ds_config

ROOT = Path(__file__).resolve().parents[2]


def _nested(dotted: str, value) -> dict:
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


@pytest.mark.parametrize("key", sorted(OWNED_DS_KEYS))
def test_owned_key_refused_naming_ours(key, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"wall_clock_breakdown": False, **_nested(key, 2)}))
    with pytest.raises(ConfigError) as err:
        load_ds_config(path)
    assert f"sets {key}," in str(err.value) and OWNED_DS_KEYS[key] in str(err.value)
    assert str(path) in str(err.value)


def test_shipped_ds_configs_pass_and_their_knobs_are_kept():
    shipped = sorted((ROOT / "ds_configs").glob("*.json"))
    assert len(shipped) >= 4
    for path in shipped:
        assert load_ds_config(path) == json.loads(path.read_text())


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{\"zero_optimization\": {", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"zero_optimization": {"stage": 2}}), "sets zero_optimization.stage,"),
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
