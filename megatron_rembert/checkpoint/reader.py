"""Reading a checkpoint tensor by tensor, whatever its layout.

Two kinds of `step_XXXXXXXX/` folders are read:
- DeepSpeed's files as the trainer saves them (pp = 1: `mp_rank_{tp}_model_states.pt` with the
  TP shard under `module`; pp > 1: `layer_{idx}-model_{tp}-model_states.pt` per pipeline layer;
  ZeRO-1/2 optimizer partitions `zero_pp_rank_{dp}_mp_rank_{pp*tp+tp}_optim_states.pt`);
- the portable format (portable.py): full tensors per pipeline layer.

Both give full (TP-merged) tensors with the vocabulary padding stripped, one at a time; files
are memory-mapped, so the peak memory is about one full tensor. The folder is checked against
its manifest before any file is opened, and every pickle is loaded with `weights_only=True`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from megatron_rembert.checkpoint import CheckpointError
from megatron_rembert.checkpoint.files import deepspeed_safe_globals, torch_load_weights
from megatron_rembert.checkpoint.portable import PortableReader, is_portable
from megatron_rembert.checkpoint.specs import (
    ParamSpec,
    global_name,
    merge_shards,
    param_specs,
    pipe_name,
    shard,
)
from megatron_rembert.checkpoint.step_folder import StepFolder, verify
from megatron_rembert.config import ConfigError, ModelConfig, get_preset


def model_config(meta: dict, path: Path) -> ModelConfig:
    """The ModelConfig recorded in a meta.json (`config.model`: a preset plus its fields)."""
    raw = dict(meta["config"]["model"])
    try:
        return get_preset(raw.pop("preset", "rembert")).replace(**raw)
    except (ConfigError, TypeError) as err:
        raise CheckpointError(f"{path}: config.model is not a model this code knows ({err})"
                              ) from err


class CheckpointReader:
    """A complete, verified `step_*` folder; `full_weight` / `full_state` give full tensors."""

    def __init__(self, step: StepFolder, verify_files: bool = True):
        """verify_files=False: the caller has checked the manifest already."""
        self.folder, self.meta = step.path, step.meta
        if verify_files:
            verify(self.folder)
        self.model: ModelConfig = model_config(self.meta, self.folder / "meta.json")
        layout = self.meta["layout"]
        self.tp, self.pp = int(layout.get("tp") or 1), int(layout.get("pp") or 1)
        self.portable = is_portable(self.meta)
        self.weights_only = bool(self.meta.get("weights_only", False))
        self.specs = param_specs(self.model, 1 if self.portable else self.tp)
        self._by_name = {s.name: s for s in self.specs}
        self._files: dict[Path, object] = {}
        self._optim_index: dict[tuple[int, str], list] | None = None
        self._allowed = deepspeed_safe_globals() if not self.portable else []
        self._portable = PortableReader(self.folder) if self.portable else None

    # -- model weights -----------------------------------------------------------------
    def _load(self, path: Path):
        if path not in self._files:
            self._files[path] = torch_load_weights(path, allowed=self._allowed)
        return self._files[path]

    def _weight_shard(self, spec: ParamSpec, tp_rank: int) -> torch.Tensor:
        if self.pp == 1:
            path = self.folder / f"mp_rank_{tp_rank:02d}_model_states.pt"
            module = self._load(path)
            module = module.get("module") if isinstance(module, dict) else None
            if module is None or spec.name not in module:
                raise CheckpointError(f"{path}: no tensor {spec.name}")
            return module[spec.name]
        layer, inner = pipe_name(spec.name, self.model.num_hidden_layers)
        path = self.folder / f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"
        tensors = self._load(path)
        if inner not in tensors:
            raise CheckpointError(f"{path}: no tensor {inner}")
        return tensors[inner]

    def weight_dtype(self, spec: ParamSpec) -> torch.dtype:
        """The dtype `full_weight` returns, read without merging (or touching) the tensor."""
        if self._portable is not None:
            return self._portable.dtype(spec.name)
        return self._weight_shard(spec, 0).dtype

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
        spec = self._own(spec)
        return merge_shards([self._weight_shard(spec, r) for r in range(self.tp)], spec)

    # -- optimizer state ---------------------------------------------------------------
    def _zero_files(self) -> list[Path]:
        files = sorted(self.folder.glob("zero_pp_rank_*_mp_rank_*_optim_states.pt"))
        if not files:
            stage = self.meta["config"].get("parallel", {}).get("zero_stage")
            raise CheckpointError(
                f"{self.folder}: no ZeRO optimizer files (zero_pp_rank_*_optim_states.pt); "
                f"this checkpoint was saved with parallel.zero_stage={stage}. Resharding "
                "optimizer state needs ZeRO stage 1 or 2; convert the weights only "
                "(--weights-only) or train with parallel.zero_stage=1")
        return files

    def _index_optimizer(self) -> dict[tuple[int, str], list]:
        """(tp_rank, global name) -> [(dp_rank, file, group, start, numel)] by DP rank."""
        index: dict[tuple[int, str], list] = {}
        steps: dict[int, float] = {}
        self.loss_scale = 1.0
        for path in self._zero_files():
            parts = path.name.split("_")  # zero pp rank {dp} mp rank {mp} optim states.pt
            dp_rank, mp_rank = int(parts[3]), int(parts[6])
            osd = self._load(path)["optimizer_state_dict"]
            for group, mapping in enumerate(osd["param_slice_mappings"]):
                for engine_name, addr in mapping.items():
                    index.setdefault((mp_rank % self.tp, self._global_name(engine_name)),
                                     []).append((dp_rank, path, group, addr.start, addr.numel))
                step = osd["base_optimizer_state"]["state"].get(group, {}).get("step")
                if step is not None:
                    steps[group] = float(step)
            self.loss_scale = float(getattr(osd.get("loss_scaler"), "cur_scale", 1.0))
        self.optimizer_steps = [steps[g] for g in sorted(steps)]
        for fragments in index.values():
            fragments.sort(key=lambda f: f[0])
        return index

    def _global_name(self, engine_name: str) -> str:
        if self.pp == 1:
            return engine_name
        idx, inner = engine_name.split(".", 1)
        return global_name(int(idx), inner, self.model.num_hidden_layers)

    def _state_shard(self, spec: ParamSpec, tp_rank: int, key: str) -> torch.Tensor:
        pieces = []
        for _, path, group, start, numel in self._optim_index.get((tp_rank, spec.name), []):
            osd = self._load(path)["optimizer_state_dict"]
            flat = (osd["single_partition_of_fp32_groups"][group] if key == "fp32"
                    else osd["base_optimizer_state"]["state"][group][key])
            pieces.append(flat[start:start + numel])
        shape = spec.local_shape(self.tp)
        total = sum(p.numel() for p in pieces)
        if total != math.prod(shape):
            raise CheckpointError(f"{self.folder}: optimizer fragments of {spec.name} (TP rank "
                                  f"{tp_rank}) hold {total} values, expected {math.prod(shape)}")
        return torch.cat(pieces).reshape(shape)

    def full_state(self, spec: ParamSpec, key: str) -> torch.Tensor:
        """key: 'fp32' (master weight), 'exp_avg' or 'exp_avg_sq'; full, vocabulary stripped."""
        if self.weights_only:
            raise CheckpointError(f"{self.folder}: a weights-only checkpoint has no optimizer "
                                  "state")
        if self._portable is not None:
            return self._portable.full(spec.name if key == "fp32" else f"{key}/{spec.name}")
        if self._optim_index is None:
            self._optim_index = self._index_optimizer()
        spec = self._own(spec)
        return merge_shards([self._state_shard(spec, r, key) for r in range(self.tp)], spec)

    def local_shard(self, key: str, spec: ParamSpec, tp: int, tp_rank: int) -> torch.Tensor:
        """TP rank `tp_rank` of `tp` of the optimizer's tensor `key` (NAME: the fp32 master
        weight, or exp_avg/NAME, exp_avg_sq/NAME): what a portable checkpoint stores, so the
        trainer loads this folder at another layout as it loads a portable one."""
        state, _, name = key.rpartition("/")
        source = next((s for s in self.specs if s.name == name), None)
        if source is None:
            raise CheckpointError(f"{self.folder}: no parameter {name}")
        full = self.full_state(source, state or "fp32")
        if tuple(full.shape) != spec.shape:
            raise CheckpointError(f"{self.folder}: {key} has shape {tuple(full.shape)}, the "
                                  f"model expects {spec.shape}")
        return shard(full, spec, tp, tp_rank)

    def optimizer_meta(self) -> dict:
        """Step counts per parameter group, LR schedule, counters: what resumes the optimizer."""
        if self.portable:
            return dict(self.meta["optimizer"])
        if self._optim_index is None:
            self._optim_index = self._index_optimizer()
        states = self._load(self.folder / "mp_rank_00_model_states.pt")
        return {"steps": self.optimizer_steps, "lr_scheduler": states.get("lr_scheduler"),
                "skipped_steps": int(states.get("skipped_steps", 0)),
                "loss_scale": self.loss_scale}

    def close(self) -> None:
        self._files.clear()
        if self._portable is not None:
            self._portable.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
