"""Reading our training checkpoints tensor by tensor, whatever their layout.

Two kinds of `step_XXXXXXXX/` folders are read:
- DeepSpeed's files as the trainer saves them (pp = 1: `mp_rank_{tp}_model_states.pt` with the
  TP shard under `module`; pp > 1: `layer_{idx}-model_{tp}-model_states.pt` per pipeline layer;
  ZeRO-1/2 optimizer partitions `zero_pp_rank_{dp}_mp_rank_{pp*tp+tp}_optim_states.pt`);
- the portable format (`megatron_rembert.training.portable`): full tensors per pipeline layer.

Both give full (TP-merged) tensors with the vocabulary padding stripped, one at a time; files
are memory-mapped, so the peak memory is about one full tensor.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rembert.config import ModelConfig
from megatron_rembert.convert.files import ConvertError, torch_load_weights
from megatron_rembert.parallel import state
from megatron_rembert.training.checkpoint import COMPLETE, read_meta
from megatron_rembert.training.config import Config, build_config
from megatron_rembert.training.portable import PORTABLE_FORMAT, read_index, safe_open_checked


@contextmanager
def parallel_state(tp: int, tp_rank: int = 0):
    """Pretend to be TP rank `tp_rank` of `tp` (offline, no process groups)."""
    old = state._STATE
    state._STATE = state.ParallelState(tp=tp, tp_rank=tp_rank)
    try:
        yield
    finally:
        state._STATE = old


@dataclass(frozen=True)
class ParamSpec:
    name: str  # global name, e.g. rembert.layers.3.attention.query.weight
    split_dim: int | None  # dimension split across TP ranks, None when replicated
    padded_shape: tuple[int, ...]  # full shape at this TP size (vocabulary padded)
    shape: tuple[int, ...]  # full shape without vocabulary padding (what files store)
    layer: int  # pipeline layer: 0 embeddings, 1..L Transformer layers, L+1 MLM head

    def local_shape(self, tp: int) -> tuple[int, ...]:
        shape = list(self.padded_shape)
        if self.split_dim is not None:
            shape[self.split_dim] //= tp
        return tuple(shape)


def pipeline_layer(name: str, num_layers: int) -> int:
    if name.startswith("rembert.embeddings."):
        return 0
    if name.startswith("rembert.layers."):
        return int(name.split(".")[2]) + 1
    if name.startswith("mlm_head."):
        return num_layers + 1
    raise ConvertError(f"parameter {name!r} belongs to no pipeline layer")


def pipe_name(name: str, num_layers: int) -> tuple[int, str]:
    """Global name -> (pipeline layer index, name inside that layer) as PipelineModule saves."""
    layer = pipeline_layer(name, num_layers)
    prefix = ("rembert.embeddings." if layer == 0 else "mlm_head." if layer == num_layers + 1
              else f"rembert.layers.{layer - 1}.")
    return layer, name[len(prefix):]


def param_specs(config: ModelConfig, tp: int = 1) -> list[ParamSpec]:
    """Every trainable parameter of the pre-training model at TP size `tp` (meta device)."""
    from megatron_rembert.model.rembert import RemBertForPreTraining

    with parallel_state(tp), torch.device("meta"):
        model = RemBertForPreTraining(config)
    specs = []
    for name, p in model.named_parameters():
        padded = tuple(getattr(p, "full_shape", tuple(p.shape)))
        rows = getattr(p, "vocab_rows", None)
        shape = (rows, *padded[1:]) if rows is not None else padded
        specs.append(ParamSpec(name, getattr(p, "tp_split_dim", None), padded, shape,
                               pipeline_layer(name, config.num_hidden_layers)))
    return specs


def merge_shards(shards: list[torch.Tensor], spec: ParamSpec) -> torch.Tensor:
    """TP shards -> the full tensor, vocabulary padding stripped."""
    full = shards[0] if spec.split_dim is None else torch.cat(shards, dim=spec.split_dim)
    if tuple(full.shape) != spec.padded_shape:
        raise ConvertError(f"{spec.name}: merged shape {tuple(full.shape)}, expected "
                           f"{spec.padded_shape}")
    return full[: spec.shape[0]] if spec.shape != spec.padded_shape else full


def check_step_dir(folder: str | Path) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise ConvertError(f"--checkpoint {folder}: no such folder")
    if not (folder / COMPLETE).exists():
        raise ConvertError(f"--checkpoint {folder}: no '{COMPLETE}' marker: the save was "
                           "interrupted or is still running; use a complete step_* folder")
    if not (folder / "meta.json").is_file():
        raise ConvertError(f"--checkpoint {folder}: no meta.json")
    return folder


class CheckpointReader:
    """A `step_*` folder of either kind; `full_weight` / `full_state` return full tensors."""

    def __init__(self, folder: str | Path):
        self.folder = check_step_dir(folder)
        self.meta = read_meta(self.folder)
        raw = self.meta.get("config")
        if not isinstance(raw, dict) or "model" not in raw:
            raise ConvertError(f"{self.folder / 'meta.json'}: no training config in it")
        self.config: Config = build_config(raw)
        self.model: ModelConfig = self.config.model
        layout = self.meta.get("layout") or {}
        self.tp, self.pp = int(layout.get("tp", 1)), int(layout.get("pp", 1))
        self.portable = self.meta.get("format") == PORTABLE_FORMAT
        self.weights_only = bool(self.meta.get("weights_only", False))
        self.specs = param_specs(self.model, 1 if self.portable else self.tp)
        self._files: dict[Path, object] = {}
        self._optim_index: dict[tuple[int, str], list] | None = None
        if self.portable:
            self._portable_index = read_index(self.folder)

    # -- model weights -----------------------------------------------------------------
    def _load(self, path: Path, allowed: tuple = ()):
        if path not in self._files:
            self._files[path] = torch_load_weights(path, allowed=allowed)
        return self._files[path]

    def _weight_shard(self, spec: ParamSpec, tp_rank: int) -> torch.Tensor:
        if self.pp == 1:
            module = self._load(self.folder / f"mp_rank_{tp_rank:02d}_model_states.pt")
            module = module.get("module") if isinstance(module, dict) else None
            if module is None or spec.name not in module:
                raise ConvertError(f"{self.folder}/mp_rank_{tp_rank:02d}_model_states.pt: no "
                                   f"tensor {spec.name}")
            return module[spec.name]
        layer, inner = pipe_name(spec.name, self.model.num_hidden_layers)
        path = self.folder / f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"
        tensors = self._load(path)
        if inner not in tensors:
            raise ConvertError(f"{path}: no tensor {inner}")
        return tensors[inner]

    def full_weight(self, spec: ParamSpec) -> torch.Tensor:
        """The model weight as training holds it (its dtype), full, vocabulary stripped."""
        if self.portable:
            return self._portable(spec.name)
        return merge_shards([self._weight_shard(spec, r) for r in range(self.tp)], spec)

    def _portable(self, key: str) -> torch.Tensor:
        if key not in self._portable_index:
            raise ConvertError(f"{self.folder}: index.json names no tensor {key}")
        with safe_open_checked(self.folder / self._portable_index[key]) as f:
            return f.get_tensor(key)

    # -- optimizer state ---------------------------------------------------------------
    def _zero_files(self) -> list[Path]:
        files = sorted(self.folder.glob("zero_pp_rank_*_mp_rank_*_optim_states.pt"))
        if not files:
            stage = self.config.parallel.zero_stage
            raise ConvertError(
                f"{self.folder}: no ZeRO optimizer files (zero_pp_rank_*_optim_states.pt); "
                f"this checkpoint was saved with parallel.zero_stage={stage}. Resharding "
                "optimizer state needs ZeRO stage 1 or 2; convert the weights only "
                "(--weights-only) or train with parallel.zero_stage=1")
        return files

    def _index_optimizer(self) -> dict[tuple[int, str], list]:
        """(tp_rank, global name) -> [(file, group, start, numel)] ordered by DP rank."""
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        self._allowed = (fragment_address, LossScaler, DynamicLossScaler, ZeroStageEnum)
        index: dict[tuple[int, str], list] = {}
        steps: dict[int, float] = {}
        for path in self._zero_files():
            parts = path.name.split("_")  # zero pp rank {dp} mp rank {mp} optim states.pt
            dp_rank, mp_rank = int(parts[3]), int(parts[6])
            osd = self._load(path, self._allowed)["optimizer_state_dict"]
            for group, mapping in enumerate(osd["param_slice_mappings"]):
                for engine_name, addr in mapping.items():
                    name = self._global_name(engine_name)
                    index.setdefault((mp_rank % self.tp, name), []).append(
                        (dp_rank, path, group, addr.start, addr.numel))
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
        layer, n = int(idx), self.model.num_hidden_layers
        prefix = ("rembert.embeddings." if layer == 0 else "mlm_head." if layer == n + 1
                  else f"rembert.layers.{layer - 1}.")
        return prefix + inner

    def _state_shard(self, spec: ParamSpec, tp_rank: int, key: str) -> torch.Tensor:
        pieces = []
        for _, path, group, start, numel in self._optim_index.get((tp_rank, spec.name), []):
            osd = self._load(path, self._allowed)["optimizer_state_dict"]
            flat = (osd["single_partition_of_fp32_groups"][group] if key == "fp32"
                    else osd["base_optimizer_state"]["state"][group][key])
            pieces.append(flat[start:start + numel])
        shape = spec.local_shape(self.tp)
        total = sum(p.numel() for p in pieces)
        if total != math.prod(shape):
            raise ConvertError(f"{self.folder}: optimizer fragments of {spec.name} (TP rank "
                               f"{tp_rank}) hold {total} values, expected {math.prod(shape)}")
        return torch.cat(pieces).reshape(shape)

    def full_state(self, spec: ParamSpec, key: str) -> torch.Tensor:
        """key: 'fp32' (master weight), 'exp_avg' or 'exp_avg_sq'; full, vocabulary stripped."""
        if self.weights_only:
            raise ConvertError(f"{self.folder}: a weights-only checkpoint has no optimizer state")
        if self.portable:
            return self._portable(spec.name if key == "fp32" else f"{key}/{spec.name}")
        if self._optim_index is None:
            self._optim_index = self._index_optimizer()
        return merge_shards([self._state_shard(spec, r, key) for r in range(self.tp)], spec)

    def optimizer_meta(self) -> dict:
        """Step counts per parameter group, LR schedule, counters: what resumes the optimizer."""
        if self.portable:
            return dict(self.meta["optimizer"])
        if self._optim_index is None:
            self._optim_index = self._index_optimizer()
        path = self.folder / "mp_rank_00_model_states.pt"
        states = self._load(path)
        return {"steps": self.optimizer_steps, "lr_scheduler": states.get("lr_scheduler"),
                "skipped_steps": int(states.get("skipped_steps", 0)),
                "loss_scale": self.loss_scale}

    def close(self) -> None:
        self._files.clear()
