"""`--set` values: string keys take the text as it is (no YAML), the others YAML scalars; an
unknown key or section suggests the close one."""

import pytest

from megatron_rembert.config import ConfigError
from megatron_rembert.run_config.load import build_config


def test_string_keys_take_the_text_as_is():
    config = build_config({}, ["train.save_dir=2024", "train.log_dir=true", "data.path=1e3",
                               "parallel.ds_config=null", "train.steps=20", "optim.lr=3e-4"])
    assert config.train.save_dir == "2024" and config.train.log_dir == "true"
    assert config.data.path == "1e3" and config.parallel.ds_config == "null"
    assert config.train.steps == 20 and config.optim.lr == 3e-4  # numbers still parsed


def test_yaml_number_for_a_string_key_says_to_quote_it():
    with pytest.raises(ConfigError, match=r"train.save_dir: expected str, got 2024 \(quote it"):
        build_config({"train": {"save_dir": 2024}})


@pytest.mark.parametrize("item, message", [
    ("train.stpes=5", r"unknown key train.stpes; did you mean train.steps\?"),
    ("optim.learning_rate=1", r"unknown key optim.learning_rate \(train.py --help"),
    ("trian.steps=5", r"unknown config section 'trian'; did you mean train\?"),
    ("model.preset=rembrt", r"unknown model preset 'rembrt'; did you mean rembert\?"),
])
def test_unknown_key_suggests_the_close_one(item, message):
    with pytest.raises(ConfigError, match=message) as err:
        build_config({}, [item])
    assert "micro_batch_size" not in str(err.value)  # no list of every key
