""""Can this model be built at tp x pp" is one question (`config.check_buildable`): train.py,
`convert reshard` and `convert from-hf` refuse the same layouts in the same words."""

from pathlib import Path

import pytest

from megatron_rembert.config import ConfigError, check_buildable, get_preset
from megatron_rembert.convert.__main__ import main as convert_main
from megatron_rembert.convert.files import ConvertError, check_tp_pp
from megatron_rembert.convert.hf import HF_FIELDS
from megatron_rembert.train import main as train_main
from tests.model.helpers import small_config

pytest.importorskip("transformers")  # the hf_dir fixture (conftest.py)

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def _error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0].removeprefix("error: ")


@pytest.mark.parametrize("tp, pp, words", [
    (4, 1, "model.num_attention_heads=6 is not divisible by parallel.tp=4"),
    (1, 4, "model.num_hidden_layers=3 is fewer than parallel.pp=4 pipeline stages"),
])
def test_train_reshard_and_from_hf_refuse_alike(hf_dir, tmp_path, capsys, tp, pp, words):
    model = [f"model.{k}={getattr(small_config(), k)}" for k in HF_FIELDS]
    sets = [*model, f"parallel.tp={tp}", f"parallel.pp={pp}",
            f"train.save_dir={tmp_path / 'ckpt'}", f"train.log_dir={tmp_path / 'logs'}"]
    assert train_main(["--config", TINY, "--dry-run",
                       *[a for s in sets for a in ("--set", s)]]) == 2
    trainer = _error_line(capsys)
    assert words in trainer
    flags = ["--tp", str(tp), "--pp", str(pp)]
    assert convert_main(["reshard", "--checkpoint", str(hf_dir / "ckpt"),
                         "--out", str(tmp_path / "r"), *flags]) == 2
    assert _error_line(capsys) == f"--tp {tp} --pp {pp}: {trainer}"
    assert convert_main(["from-hf", "--model", str(hf_dir / "hf"),
                         "--out", str(tmp_path / "f"), *flags]) == 2
    assert _error_line(capsys) == f"--tp {tp} --pp {pp}: {trainer}"
    assert not (tmp_path / "r").exists() and not (tmp_path / "f").exists()


def test_tied_embeddings_need_one_stage_everywhere(capsys):
    """No tied checkpoint to reshard exists (from-hf writes decoupled models): the converters'
    check (`check_tp_pp`, what reshard and from-hf call) against train.py's."""
    assert train_main(["--config", TINY, "--dry-run", "--set",
                       "model.preset=coupled", "--set", "parallel.pp=2"]) == 2
    trainer = _error_line(capsys)
    assert "model.tie_embeddings=true needs parallel.pp=1" in trainer
    with pytest.raises(ConvertError) as err:
        check_tp_pp(get_preset("coupled"), 1, 2)
    assert str(err.value) == f"--tp 1 --pp 2: {trainer}"
    check_tp_pp(get_preset("coupled"), 2, 1)  # one stage: fine
    with pytest.raises(ConfigError, match="tie_embeddings"):
        check_buildable(get_preset("coupled"), 1, 2)
