"""Reshard a training checkpoint to another TP x PP (x DP) layout, optimizer state included.

The output is a portable checkpoint (megatron_rembert/checkpoint/portable.py): full fp32
master weights (`CheckpointReader.master_weight`, also with --weights-only) and Adam moments
per pipeline layer, plus step counts, LR schedule and the data
position (`consumed_samples`, a global count, so the DP size may change too). The trainer
loads it at the layout its config asks for; `--tp/--pp` (each defaults to the checkpoint's) are
checked against the model here, so a layout that cannot be built fails now rather than on the
cluster.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from megatron_rembert.checkpoint.portable import write_portable
from megatron_rembert.checkpoint.reader import CheckpointReader
from megatron_rembert.checkpoint.specs import param_specs
from megatron_rembert.checkpoint.step_folder import resolve_checkpoint
from megatron_rembert.convert.files import (
    check_out_apart,
    check_tp_pp,
    checkpoint_inputs,
    staged_output,
)
from megatron_rembert.convert.tensor_check import check_checkpoint
from megatron_rembert.run_config.schema import ZERO_STAGE


def reshard(checkpoint: str, out: str, tp: int | None, pp: int | None, force: bool,
            weights_only: bool = False, log=print) -> Path:
    """`checkpoint`: a step folder or a save folder (its `latest`); tp/pp None: unchanged."""
    source = resolve_checkpoint(checkpoint)
    check_out_apart(out, checkpoint_inputs("--checkpoint", checkpoint, source.path))
    with CheckpointReader(source) as reader:
        tp = reader.tp if tp is None else tp
        pp = reader.pp if pp is None else pp
        weights_only = weights_only or reader.weights_only
        check_checkpoint(reader)
        check_tp_pp(reader.model, tp, pp)
        specs = param_specs(reader.model, 1)
        config = copy.deepcopy(reader.meta["config"])
        parallel = config.setdefault("parallel", {})
        parallel["tp"], parallel["pp"], parallel["zero_stage"] = tp, pp, ZERO_STAGE
        meta = {"config": config, "tokenizer_sha256": reader.meta.get("tokenizer_sha256"),
                "dataset_sha256": reader.meta.get("dataset_sha256"),
                "layout": {"tp": tp, "pp": pp, "dp": None},
                "consumed_samples": int(reader.meta["consumed_samples"]),
                "source": str(reader.folder)}
        step = int(reader.meta["step"])
        if weights_only:
            dtypes = {s.name: reader.master_dtype(s) for s in specs}
            weight, state = reader.master_weight, None
        else:
            meta["optimizer"] = reader.optimizer_meta()
            dtypes = {s.name: torch.float32 for s in specs}
            weight, state = reader.master_weight, reader.full_state
        with staged_output(out, force) as tmp:
            write_portable(tmp, specs, step, meta, weight, state, dtypes)
    log(f"wrote {out} (step {step}, {meta['consumed_samples']} samples consumed, "
        f"{'weights only' if weights_only else 'with optimizer state'}) for tp={tp} pp={pp}")
    return Path(out)
