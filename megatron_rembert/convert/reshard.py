"""Reshard a training checkpoint to another TP x PP (x DP) layout, optimizer state included.

The output is a portable checkpoint (see `portable.py`): full fp32 master weights and Adam
moments per pipeline layer, plus step counts, LR schedule and the data position
(`consumed_samples`, a global count, so the DP size may change too). The trainer loads it at
the layout its config asks for; `--tp/--pp` are checked against the model here, so a layout
that cannot be built fails now rather than on the cluster.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rembert.config import ConfigError
from megatron_rembert.convert.checkpoint_io import CheckpointReader, param_specs
from megatron_rembert.convert.files import ConvertError, staged_output
from megatron_rembert.convert.portable import write_portable


def check_layout(reader: CheckpointReader, tp: int, pp: int) -> None:
    try:
        reader.model.validate(tp)
    except ConfigError as err:
        raise ConvertError(f"--tp {tp}: {err}") from err
    if pp < 1 or reader.model.num_hidden_layers < pp:
        raise ConvertError(f"--pp {pp}: needs 1 <= pp <= num_hidden_layers="
                           f"{reader.model.num_hidden_layers}")
    if pp > 1 and reader.model.tie_embeddings:
        raise ConvertError(f"--pp {pp}: a tied-embedding model needs pp=1")


def reshard(checkpoint: str, out: str, tp: int, pp: int, force: bool,
            weights_only: bool = False, log=print) -> Path:
    reader = CheckpointReader(checkpoint)
    check_layout(reader, tp, pp)
    weights_only = weights_only or reader.weights_only
    specs = param_specs(reader.model, 1)
    config = reader.config
    config.parallel.tp, config.parallel.pp = tp, pp
    if pp > 1:
        config.parallel.zero_stage = 1  # what pipeline parallelism needs (validate_config)
    meta = {"config": config.to_dict(), "tokenizer_sha256": reader.meta.get("tokenizer_sha256"),
            "layout": {"tp": tp, "pp": pp, "dp": None},
            "consumed_samples": int(reader.meta.get("consumed_samples", 0)),
            "source": str(reader.folder)}
    step = int(reader.meta.get("step", 0))
    if weights_only:
        dtypes = {s.name: reader.full_weight(s).dtype for s in specs}
        weight, state = reader.full_weight, None
    else:
        meta["optimizer"] = reader.optimizer_meta()
        dtypes = {s.name: torch.float32 for s in specs}

        def weight(s):
            return reader.full_state(s, "fp32")

        state = reader.full_state
    with staged_output(out, force) as tmp:
        write_portable(tmp, specs, step, meta, weight, state, dtypes)
    reader.close()
    log(f"wrote {out} (step {step}, {meta['consumed_samples']} samples consumed, "
        f"{'weights only' if weights_only else 'with optimizer state'}) for tp={tp} pp={pp}")
    return Path(out)
