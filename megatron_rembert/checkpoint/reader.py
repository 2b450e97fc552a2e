"""Reading a checkpoint tensor by tensor, whatever its layout.

Two kinds of `step_XXXXXXXX/` folders are read:
- the trainer's (meta.json's `optimizer_format`, `deepspeed_files: false`): each rank's
  optimizer shard file (checkpoint/optimizer_shards.py: fp32 masters and moments by global
  name and element range), the LR schedule and, from DeepSpeed's fp16 path, the loss scaler's
  state in meta.json. The masters are the weights of record; the weights as trained are them
  rounded to the training precision;
- the portable format (portable.py): full tensors per pipeline layer.

A folder of DeepSpeed's files (`mp_rank_*_model_states.pt`, ZeRO partitions), what the
trainer's version 0.1.0 wrote, is refused with one error saying how to convert it (README,
"Checkpoints").

All give full (TP-merged) tensors with the vocabulary padding stripped, one at a time; files
are memory-mapped, so the peak memory is about one full tensor. The folder is checked against
its manifest before any file is opened; nothing here unpickles.

`master_weight` is what every conversion reads: the fp32 master weight wherever the checkpoint
keeps one (a bf16 or fp16 run's weights are rounded copies of it), in one place.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from megatron_rembert.checkpoint import CheckpointError, optimizer_shards
from megatron_rembert.checkpoint.files import DTYPES, StoredTensor
from megatron_rembert.checkpoint.portable import PortableReader, is_portable
from megatron_rembert.checkpoint.specs import ParamSpec, param_specs, shard
from megatron_rembert.checkpoint.step_folder import DEEPSPEED_FILES, StepFolder, verify
from megatron_rembert.config import ConfigError, ModelConfig, get_preset


def model_config(meta: dict, path: Path) -> ModelConfig:
    """The ModelConfig recorded in a meta.json (`config.model`: a preset plus its fields)."""
    raw = dict(meta["config"]["model"])
    try:
        return get_preset(raw.pop("preset", "rembert")).replace(**raw)
    except (ConfigError, TypeError) as err:
        raise CheckpointError(f"{path}: config.model is not a model this code knows ({err})"
                              ) from err


def check_format(step: StepFolder) -> None:
    """Refuse a folder of DeepSpeed's files (what version 0.1.0 wrote) with one
    error saying how to convert it."""
    meta = step.meta
    if is_portable(meta):
        return
    if meta.get("optimizer_format") != optimizer_shards.FORMAT or meta.get(DEEPSPEED_FILES,
                                                                           True):
        raise CheckpointError(
            f"{step.path}: a checkpoint of DeepSpeed's files, written by megatron-rembert "
            "0.1.0; this version reads only its own format and the portable "
            "one. Convert it once with 0.1.0 (this repository at commit 339bab6): "
            f"rembert-convert reshard --checkpoint {step.path} --out NEW_DIR --tp T --pp P "
            "writes the portable format, which train.py resumes and every command reads")


class CheckpointReader:
    """A complete, verified `step_*` folder; `full_weight` / `full_state` give full tensors."""

    def __init__(self, step: StepFolder, verify_files: bool = True):
        """verify_files=False: the caller has checked the manifest already."""
        self.folder, self.meta = step.path, step.meta
        if verify_files:
            verify(self.folder)
        check_format(step)
        self.model: ModelConfig = model_config(self.meta, self.folder / "meta.json")
        layout = self.meta["layout"]
        self.tp, self.pp = int(layout.get("tp") or 1), int(layout.get("pp") or 1)
        self.portable = is_portable(self.meta)
        self.weights_only = bool(self.meta.get("weights_only", False))
        self.specs = param_specs(self.model, 1 if self.portable else self.tp)
        self._by_name = {s.name: s for s in self.specs}
        self._shards: optimizer_shards.SavedShards | None = None  # opened when first read
        self._portable = PortableReader(self.folder) if self.portable else None

    # -- model weights -----------------------------------------------------------------
    def stored_weights(self) -> dict[tuple[str, int], StoredTensor]:
        """Every tensor a portable checkpoint's files hold (full tensors, TP rank 0; optimizer
        state as `exp_avg/NAME`), without reading data; the trainer's folders hold no module
        weights (see `stored_optimizer`). What the caller checks against the model's
        parameters before converting."""
        return {(t.name, 0): t for t in self._portable.stored()} if self._portable else {}

    def weight_dtype(self, spec: ParamSpec) -> torch.dtype:
        """The dtype `full_weight` returns, read without merging (or touching) the tensor."""
        if self._portable is not None:
            return self._portable.dtype(spec.name)
        return DTYPES[self.meta["config"]["train"]["precision"]]

    def _own(self, spec: ParamSpec) -> ParamSpec:
        """The spec of `spec`'s parameter at this checkpoint's TP size: the vocabulary padding
        of the stored shards depends on it (a caller's spec may be for another TP size)."""
        if spec.name not in self._by_name:
            raise CheckpointError(f"{self.folder}: no parameter {spec.name}")
        return self._by_name[spec.name]

    def full_weight(self, spec: ParamSpec) -> torch.Tensor:
        """The model weight as training holds it (its dtype), full, vocabulary stripped."""
        if self._portable is not None:
            return self._portable.full(spec.name)
        # the trainer's weights are its masters rounded to the training precision
        return self.full_state(spec, "fp32").to(self.weight_dtype(spec))

    # -- optimizer state ---------------------------------------------------------------
    def _saved_shards(self) -> optimizer_shards.SavedShards:
        if self._shards is None:
            files = optimizer_shards.files_of(self.folder)
            if not files:
                raise CheckpointError(f"{self.folder}: no optimizer shard files "
                                      "(optim_tp*_pp*_dp*.safetensors), though meta.json names "
                                      "their format: the folder is incomplete; copy it again")
            self._shards = optimizer_shards.SavedShards(files).__enter__()
        return self._shards

    def stored_optimizer(self) -> dict[tuple[str, int], StoredTensor]:
        """What the trainer's shard files hold of each parameter's master, by (global name,
        writer's TP rank), from their headers: the total size of its fragments as a 1-d
        shape, and their dtype."""
        if self._portable is not None:
            return {}
        return self._saved_shards().stored("master")

    def full_state(self, spec: ParamSpec, key: str) -> torch.Tensor:
        """key: 'fp32' (master weight), 'exp_avg' or 'exp_avg_sq'; full, vocabulary stripped."""
        if self.weights_only:
            raise CheckpointError(f"{self.folder}: a weights-only checkpoint has no optimizer "
                                  "state")
        if self._portable is not None:
            return self._portable.full(spec.name if key == "fp32" else f"{key}/{spec.name}")
        return self._saved_shards().full("master" if key == "fp32" else key, self._own(spec))

    def has_masters(self) -> bool:
        """Whether `master_weight` reads fp32 masters kept apart from the weights as trained
        (the trainer's shard files) rather than the weights as stored (a portable checkpoint
        stores the masters as its weights)."""
        return not self.portable

    def master_weight(self, spec: ParamSpec) -> torch.Tensor:
        """The most precise copy of a weight the checkpoint holds, full, vocabulary stripped:
        the fp32 master weight (`has_masters`), else the weight as stored."""
        return self.full_state(spec, "fp32") if self.has_masters() else self.full_weight(spec)

    def master_dtype(self, spec: ParamSpec) -> torch.dtype:
        """The dtype `master_weight` returns, read without merging the tensor."""
        return torch.float32 if self.has_masters() else self.weight_dtype(spec)

    def local_shard(self, key: str, spec: ParamSpec, tp: int, tp_rank: int) -> torch.Tensor:
        """TP rank `tp_rank` of `tp` of the optimizer's tensor `key` (NAME: the fp32 master
        weight, or exp_avg/NAME, exp_avg_sq/NAME): what a portable checkpoint stores, so the
        trainer loads this folder at another layout as it loads a portable one."""
        state, _, name = key.rpartition("/")
        source = self._by_name.get(name)
        if source is None:
            raise CheckpointError(f"{self.folder}: no parameter {name}")
        if tuple(source.shape) != tuple(spec.shape):
            raise CheckpointError(f"{self.folder}: {key} has shape {tuple(source.shape)}, the "
                                  f"model expects {tuple(spec.shape)}")
        if self._portable is None and tp == self.tp and not self.weights_only:
            # at the saving TP size: the saved TP shard itself, this rank's elements only
            local = source.local_shape(tp)
            return self._saved_shards().read(state or "master", source, 0, math.prod(local), tp,
                                             tp_rank).reshape(local)
        full = self.full_state(source, state or "fp32")
        if tuple(full.shape) != tuple(spec.shape):  # what the files hold, not what meta says
            raise CheckpointError(f"{self.folder}: {key} has shape {tuple(full.shape)}, the "
                                  f"model expects {tuple(spec.shape)}")
        return shard(full, spec, tp, tp_rank)

    def optimizer_meta(self) -> dict:
        """Step counts per parameter group, LR schedule, counters and the loss scaler's state:
        what resumes the optimizer."""
        if self.portable:
            return dict(self.meta["optimizer"])
        saved = self._saved_shards().meta
        inner = float(saved["inner_step"])
        scaler = self.meta.get("loss_scaler") or {}  # DeepSpeed's fp16 path saves it
        return {"steps": [inner, inner],  # the two groups of training/optim.py
                "lr_scheduler": self.meta.get("lr_scheduler"),
                "skipped_steps": int(saved["skipped_steps"]),
                "loss_scale": float(scaler.get("cur_scale", 1.0)), "loss_scaler": scaler}

    def close(self) -> None:
        if self._shards is not None:
            self._shards.__exit__(None, None, None)
            self._shards = None
        if self._portable is not None:
            self._portable.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
