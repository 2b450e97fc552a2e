"""Average the weights of several checkpoints into one portable, weights-only checkpoint.

Checkpoint averaging (e.g. the last few checkpoints of a run, or "model soups" of runs that
share a model) often gives a better model than any one of them. The inputs may be any mix of
layouts and formats (DeepSpeed's files at any TP x PP, or portable); `CheckpointReader` gives
each tensor full and TP-merged, and the mean is taken tensor by tensor: the peak memory is a
few copies of the largest tensor, never all checkpoints at once.

What is averaged: each checkpoint's `master_weight` (checkpoint/reader.py: the fp32 master
weights where a checkpoint has them, in every precision and ZeRO stage); the sum
is accumulated in float64 and the mean stored as float32, so averaging copies of one
checkpoint gives it back bit for bit. The optimizer state is not averaged (moments of
different points in training do not describe the averaged point): the output is weights
only, and a run resumed from it starts a fresh optimizer. It records the newest input's step,
`consumed_samples` and config, so such a run continues the newest input's data stream.
"""

from __future__ import annotations

import copy
import dataclasses
from contextlib import ExitStack
from pathlib import Path

import torch

from megatron_rembert.checkpoint.portable import write_portable
from megatron_rembert.checkpoint.reader import CheckpointReader, model_config
from megatron_rembert.checkpoint.specs import ParamSpec, param_specs
from megatron_rembert.checkpoint.step_folder import resolve_checkpoint
from megatron_rembert.config import EXECUTION_FIELDS, ModelConfig
from megatron_rembert.convert.files import (
    ConvertError,
    check_out_apart,
    checkpoint_inputs,
    staged_output,
)
from megatron_rembert.convert.tensor_check import check_checkpoint


def check_same_model(models: list[ModelConfig], folders: list[Path]) -> None:
    """Raise naming the first model field in which a checkpoint differs from the first one."""
    for model, folder in zip(models[1:], folders[1:], strict=True):
        for field in dataclasses.fields(ModelConfig):
            if field.name in EXECUTION_FIELDS:
                continue
            mine, first = getattr(model, field.name), getattr(models[0], field.name)
            if mine != first:
                raise ConvertError(
                    f"--checkpoints {folder}: model.{field.name}={mine!r}, but {folders[0]} "
                    f"has {first!r}; only checkpoints of one model can be averaged")


def average(checkpoints: list[str], out: str, force: bool, log=print) -> Path:
    """Write the mean weights of `checkpoints` (step or save folders) as `out/step_N/`, N the
    newest input's step. Everything (inputs, models, every stored tensor's name, shape and
    dtype) is checked before any tensor's data is read."""
    if len(checkpoints) < 2:
        raise ConvertError(f"--checkpoints: got {len(checkpoints)} checkpoint; averaging needs "
                           "at least 2")
    inputs = [resolve_checkpoint(c) for c in checkpoints]
    folders, metas = [i.path for i in inputs], [i.meta for i in inputs]
    for given, folder in zip(checkpoints, folders, strict=True):
        check_out_apart(out, checkpoint_inputs("--checkpoints", given, folder))
    check_same_model([model_config(m, f / "meta.json") for m, f in zip(metas, folders,
                                                                         strict=True)], folders)
    tokenizers = {m.get("tokenizer_sha256") for m in metas} - {None}
    if len(tokenizers) > 1:
        raise ConvertError(f"--checkpoints: trained with {len(tokenizers)} different tokenizers "
                           "(tokenizer_sha256 in meta.json); their embeddings cannot be averaged")
    newest = max(range(len(folders)), key=lambda i: int(metas[i]["step"]))
    step = int(metas[newest]["step"])
    with ExitStack() as stack:  # opening verifies every file against its manifest
        readers = [stack.enter_context(CheckpointReader(i)) for i in inputs]
        for reader in readers:
            check_checkpoint(reader)
        weights = [r.master_weight for r in readers]
        specs = param_specs(readers[0].model, 1)

        def mean(spec: ParamSpec) -> torch.Tensor:
            total = torch.zeros(spec.shape, dtype=torch.float64)
            for weight in weights:
                total += weight(spec)
            return (total / len(weights)).float()

        layout = metas[newest]["layout"]
        meta = {"config": copy.deepcopy(metas[newest]["config"]),
                "tokenizer_sha256": metas[newest].get("tokenizer_sha256"),
                "dataset_sha256": metas[newest].get("dataset_sha256"),
                "layout": {"tp": layout.get("tp") or 1, "pp": layout.get("pp") or 1, "dp": None},
                "consumed_samples": int(metas[newest]["consumed_samples"]),
                "source": str(folders[newest]),
                "averaged_from": [{"folder": str(f), "step": int(m["step"])}
                                  for f, m in zip(folders, metas, strict=True)]}
        with staged_output(out, force) as tmp:
            write_portable(tmp, specs, step, meta, mean, None,
                           {s.name: torch.float32 for s in specs})
    steps = ", ".join(str(int(m["step"])) for m in metas)
    log(f"wrote {out} (the mean of {len(folders)} checkpoints at steps {steps}; weights only, "
        f"fp32; step {step}, {meta['consumed_samples']} samples consumed)")
    return Path(out)
