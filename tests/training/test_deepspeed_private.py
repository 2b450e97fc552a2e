"""The private DeepSpeed names the trainer relies on live in training/deepspeed_private.py and
are checked at start-up: the installed DeepSpeed passes, a DeepSpeed without one of them fails
naming its version and the name, and no other module of the package uses one."""

from __future__ import annotations

import re
from pathlib import Path

import deepspeed
import pytest

from megatron_rembert.training import deepspeed_private as dsp

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rembert"
# every private DeepSpeed name the package uses (those of the tables and the accessors')
USED = sorted({name for names in dsp.PRIVATE_NAMES.values() for name in names}
              | {n for n in dsp.BF16_BUFFERS if n.startswith("_")}
              | {"_hp_mapping", "_config", "_global_grad_norm"})


def test_the_installed_deepspeed_has_every_name():
    dsp.check_private_names()


def test_a_missing_name_is_named_with_the_version(monkeypatch):
    from deepspeed.runtime.pipe.module import PipelineModule

    monkeypatch.delattr(PipelineModule, "_set_bounds")
    with pytest.raises(dsp.DeepSpeedVersionError) as err:
        dsp.check_private_names()
    assert f"DeepSpeed {deepspeed.__version__}" in str(err.value)
    assert "PipelineModule has no _set_bounds" in str(err.value)


def test_a_built_optimizer_without_a_buffer_is_named():
    class Wrapper:
        pass

    with pytest.raises(dsp.DeepSpeedVersionError, match="Wrapper has no attribute bf16_groups"):
        dsp.check_bf16_optimizer(Wrapper())


def test_no_other_module_uses_a_private_deepspeed_name():
    pattern = re.compile(r"\.(" + "|".join(map(re.escape, USED)) + r")\b|[\"'](" +
                         "|".join(map(re.escape, USED)) + r")[\"']")
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "deepspeed_private.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if pattern.search(code) and "self._config" not in code:
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not offenders, offenders
