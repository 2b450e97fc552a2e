import pytest
import torch

from megatron_rembert.convert.__main__ import main
from megatron_rembert.convert.hf import hf_config_dict
from tests.model.helpers import small_config


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """A small transformers RemBertForMaskedLM folder (`hf/`) and its from-hf save folder
    (`ckpt/`: step_00000000 and latest, tp=1 pp=1)."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = transformers.RemBertForMaskedLM(
        transformers.RemBertConfig(**hf_config_dict(small_config())))
    model.save_pretrained(root / "hf")
    assert main(["from-hf", "--model", str(root / "hf"), "--out", str(root / "ckpt")]) == 0
    return root
