"""Reading a checkpoint tensor by tensor, whatever its layout.

Three kinds of `step_XXXXXXXX/` folders are read:
- ours, as the trainer saves them on its production path (ZeRO-1 in bf16 or fp32; meta.json's
  `deepspeed_files` is false): our distributed optimizer's shard files only
  (checkpoint/optimizer_shards.py: fp32 masters and moments, per rank, by global name and
  element range), the LR schedule in meta.json. The masters are the weights of record; the
  weights as trained are them rounded to the training precision;
- DeepSpeed's files (fp16, ZeRO-2, fp32 without ZeRO, and the production path's checkpoints
  written before 2026-12-07; pp = 1: `mp_rank_{tp}_model_states.pt` with the TP shard under
  `module`, and at ZeRO stage 0 the torch optimizer's state under `optimizer`; pp > 1:
  `layer_{idx}-model_{tp}-model_states.pt` per pipeline layer), with the optimizer state either
  in our shard files (meta.json's `optimizer_format`) or, from DeepSpeed's own optimizers, in
  its ZeRO-1/2 partitions `zero_pp_rank_{dp}_mp_rank_{pp*tp+tp}_optim_states.pt` (named with a
  `bf16_` prefix when the run trained in bf16);
- the portable format (portable.py): full tensors per pipeline layer.

All give full (TP-merged) tensors with the vocabulary padding stripped, one at a time; files
are memory-mapped, so the peak memory is about one full tensor. The folder is checked against
its manifest before any file is opened, and every pickle is loaded with `weights_only=True`.

`master_weight` is what every conversion reads: the fp32 master weight wherever the checkpoint
keeps one (a bf16 or fp16 run's module weights are rounded copies of it), in one place.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from megatron_rembert.checkpoint import CheckpointError, optimizer_shards
from megatron_rembert.checkpoint.files import (
    DTYPES,
    StoredTensor,
    deepspeed_safe_globals,
    torch_load_weights,
)
from megatron_rembert.checkpoint.portable import PortableReader, is_portable
from megatron_rembert.checkpoint.specs import (
    TIED_ALIASES,
    ParamSpec,
    global_name,
    merge_shards,
    optimizer_order,
    param_specs,
    pipe_name,
    shard,
)
from megatron_rembert.checkpoint.step_folder import DEEPSPEED_FILES, StepFolder, verify
from megatron_rembert.config import ConfigError, ModelConfig, get_preset

# DeepSpeed's ZeRO optimizer files (runtime/engine.py: `_get_rank_zero_ckpt_name`): a `bf16_`
# prefix whenever the run trained in bf16 (BF16_Optimizer at ZeRO-1, ZeRO-2 too).
ZERO_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


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
        # ZeRO stage 0 (fp32, pp = 1): the torch optimizer's state in the model files, by
        # (TP rank, global name).
        self.zero_stage = int(self.meta["config"].get("parallel", {}).get("zero_stage", 0))
        # our distributed optimizer's shard files (optimizer_shards.py), opened when first read
        self.shard_files = self.meta.get("optimizer_format") == optimizer_shards.FORMAT
        self._shards: optimizer_shards.SavedShards | None = None
        # our optimizer's path since 2026-12-07: its shard files and meta.json only (the
        # masters are the weights; the weights as trained are those rounded to the precision)
        self.deepspeed_files = bool(self.meta.get(DEEPSPEED_FILES, True)) and not self.portable
        self._plain = not self.portable and not self.shard_files and self.zero_stage == 0
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

    def stored_weights(self) -> dict[tuple[str, int], StoredTensor]:
        """Every tensor the model files hold, by (global name, TP rank), without reading
        data: a portable checkpoint's full tensors (TP rank 0; optimizer state as
        `exp_avg/NAME`), or DeepSpeed's TP shards (`mp_rank_XX_model_states.pt`'s `module`,
        or the `layer_XX-model_YY` files of a pipeline). What the caller checks against the
        model's parameters before converting."""
        if self._portable is not None:
            return {(t.name, 0): t for t in self._portable.stored()}
        if not self.deepspeed_files:  # the masters' fragments (`stored_optimizer`)
            return {}
        found, layers = {}, self.model.num_hidden_layers
        if self.pp == 1:
            for path in sorted(self.folder.glob("mp_rank_*_model_states.pt")):
                module = self._load(path)
                module = module.get("module") if isinstance(module, dict) else None
                if not isinstance(module, dict):
                    raise CheckpointError(f"{path}: no 'module' state dict")
                rank = int(path.name.split("_")[2])
                found.update({(name, rank): StoredTensor.of(path, name, value)
                              for name, value in module.items()
                              if not self._tied_alias(name, module)})
            return found
        for path in sorted(self.folder.glob("layer_*-model_*-model_states.pt")):
            layer, rank = (int(part.split("_")[1]) for part in path.name.split("-")[:2])
            tensors = self._load(path)
            if not isinstance(tensors, dict):
                raise CheckpointError(f"{path}: not a state dict")
            found.update({(global_name(layer, inner, layers), rank):
                          StoredTensor.of(path, inner, value) for inner, value in tensors.items()})
        return found

    def _tied_alias(self, name: str, module: dict) -> bool:
        """A coupled model's output embedding is its input table: torch's state dict (what
        DeepSpeed saves) holds that one parameter under both names; the second is no tensor
        of its own."""
        other = TIED_ALIASES.get(name) if self.model.tie_embeddings else None
        return (other is not None and other in module
                and tuple(module[other].shape) == tuple(module[name].shape))

    def weight_dtype(self, spec: ParamSpec) -> torch.dtype:
        """The dtype `full_weight` returns, read without merging (or touching) the tensor."""
        if self._portable is not None:
            return self._portable.dtype(spec.name)
        if not self.deepspeed_files:
            return DTYPES[self.meta["config"]["train"]["precision"]]
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
        if not self.deepspeed_files:  # the module weights are the masters rounded
            return self.full_state(spec, "fp32").to(self.weight_dtype(spec))
        spec = self._own(spec)
        return merge_shards([self._weight_shard(spec, r) for r in range(self.tp)], spec)

    # -- optimizer state ---------------------------------------------------------------
    def _zero_files(self) -> list[tuple[int, int, Path]]:
        """(dp rank, mp rank, file) of every ZeRO optimizer file."""
        files = sorted((int(m.group(1)), int(m.group(2)), path)
                       for path in self.folder.iterdir()
                       if (m := ZERO_FILE.fullmatch(path.name)))
        if not files:
            raise CheckpointError(
                f"{self.folder}: no ZeRO optimizer files ([bf16_]zero_pp_rank_*_optim_states.pt)"
                f", though meta.json says parallel.zero_stage={self.zero_stage}: the folder is "
                "incomplete; copy it again")
        return files

    def _index_optimizer(self) -> dict[tuple[int, str], list]:
        """(tp_rank, global name) -> [(dp_rank, file, group, start, numel)] by DP rank."""
        if self._plain:
            return self._index_plain_optimizer()
        index: dict[tuple[int, str], list] = {}
        steps: dict[int, float] = {}
        self.loss_scale = 1.0
        for dp_rank, mp_rank, path in self._zero_files():
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

    def _index_plain_optimizer(self) -> dict[tuple[int, str], list]:
        """ZeRO stage 0: torch's optimizer state dict in each TP rank's model file, its
        parameters numbered in the order training/optim.py grouped them (`optimizer_order`).
        Each entry: [(0, file, state of that parameter, 0, numel)]."""
        index: dict[tuple[int, str], list] = {}
        names = [s.name for s in optimizer_order(self.specs)]
        self.loss_scale, steps = 1.0, {}
        for tp_rank in range(self.tp):
            path = self.folder / f"mp_rank_{tp_rank:02d}_model_states.pt"
            osd = self._load(path).get("optimizer")
            if not isinstance(osd, dict) or not isinstance(osd.get("param_groups"), list):
                raise CheckpointError(f"{path}: no optimizer state (a ZeRO stage 0 checkpoint "
                                      "keeps it under 'optimizer')")
            ids = [(g, i) for g, group in enumerate(osd["param_groups"]) for i in group["params"]]
            if len(ids) != len(names):
                raise CheckpointError(f"{path}: the optimizer holds {len(ids)} parameters, the "
                                      f"model of meta.json has {len(names)}")
            for name, (group, i) in zip(names, ids, strict=True):
                st = osd["state"].get(i, {})
                if "step" in st:
                    steps[group] = float(st["step"])
                numel = math.prod(self._by_name[name].local_shape(self.tp))
                index[(tp_rank, name)] = [(0, path, st, 0, numel)]
        self.optimizer_steps = [steps[g] for g in sorted(steps)]
        return index

    def _flat(self, path: Path, group, key: str) -> torch.Tensor:
        """The flat tensor a fragment lies in: a ZeRO partition (`group`: its index), or at
        ZeRO stage 0 one parameter's own Adam state (`group`: that parameter's state)."""
        if self._plain:  # its masters are the weights (`_state_shard`)
            if key not in group:
                raise CheckpointError(f"{path}: the optimizer holds no {key} (was the "
                                      "checkpoint saved before the first optimizer step?)")
            return group[key].reshape(-1)
        osd = self._load(path)["optimizer_state_dict"]
        return (osd["single_partition_of_fp32_groups"][group] if key == "fp32"
                else osd["base_optimizer_state"]["state"][group][key])

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
        """What the ZeRO files hold of each parameter, by (global name, TP rank), without
        merging anything: the total size of its fragments as a 1-d shape, and the dtype of
        the flat partitions they lie in (the fp32 master weights' or, if not float32, the
        first Adam moment's that is not). Names come from `param_slice_mappings`."""
        if self.shard_files:
            return self._saved_shards().stored("master")
        if self._optim_index is None:
            self._optim_index = self._index_optimizer()
        found = {}
        for (tp_rank, name), fragments in self._optim_index.items():
            dtypes = []
            for _, path, group, _, _ in fragments:
                keys = ("exp_avg", "exp_avg_sq") if self._plain else ("fp32", "exp_avg",
                                                                      "exp_avg_sq")
                flats = [self._flat(path, group, k) for k in keys]
                dtypes += [StoredTensor.of(path, name, flat).dtype for flat in flats]
            dtype = next((d for d in dtypes if d != "float32"), "float32")
            found[(name, tp_rank)] = StoredTensor(fragments[0][1], name,
                                                  (sum(f[4] for f in fragments),), dtype)
        return found

    def _global_name(self, engine_name: str) -> str:
        if self.pp == 1:
            return engine_name
        idx, inner = engine_name.split(".", 1)
        return global_name(int(idx), inner, self.model.num_hidden_layers)

    def _state_shard(self, spec: ParamSpec, tp_rank: int, key: str) -> torch.Tensor:
        if self._plain and key == "fp32":  # fp32 without ZeRO: the weights are the masters
            return self._weight_shard(spec, tp_rank)
        pieces = []
        for _, path, group, start, numel in self._optim_index.get((tp_rank, spec.name), []):
            pieces.append(self._flat(path, group, key)[start:start + numel])
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
        if self.shard_files:
            return self._saved_shards().full("master" if key == "fp32" else key, self._own(spec))
        if self._optim_index is None:
            self._optim_index = self._index_optimizer()
        spec = self._own(spec)
        return merge_shards([self._state_shard(spec, r, key) for r in range(self.tp)], spec)

    def has_masters(self) -> bool:
        """Whether `master_weight` reads fp32 masters kept apart from the module weights (the
        ZeRO files of a stage 1/2 checkpoint) rather than the weights as stored: a portable
        checkpoint's are its masters already, and without ZeRO the run trained in fp32."""
        return not self.portable and (self.shard_files or self.zero_stage > 0)

    def master_weight(self, spec: ParamSpec) -> torch.Tensor:
        """The most precise copy of a weight the checkpoint holds, full, vocabulary stripped:
        the fp32 master weight from the ZeRO files (`has_masters`), else the weight as stored
        (fp32 without ZeRO; a portable checkpoint stores the masters as its weights)."""
        return self.full_state(spec, "fp32") if self.has_masters() else self.full_weight(spec)

    def master_dtype(self, spec: ParamSpec) -> torch.dtype:
        """The dtype `master_weight` returns, read without merging the tensor."""
        return torch.float32 if self.has_masters() else self.weight_dtype(spec)

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
        if self.shard_files:
            saved = self._saved_shards().meta
            schedule = (self._load(self.folder / "mp_rank_00_model_states.pt").get(
                "lr_scheduler") if self.deepspeed_files else self.meta.get("lr_scheduler"))
            inner = float(saved["inner_step"])
            return {"steps": [inner, inner],  # the two groups of training/optim.py
                    "lr_scheduler": schedule,
                    "skipped_steps": int(saved["skipped_steps"]), "loss_scale": 1.0}
        if self._optim_index is None:
            self._optim_index = self._index_optimizer()
        states = self._load(self.folder / "mp_rank_00_model_states.pt")
        return {"steps": self.optimizer_steps, "lr_scheduler": states.get("lr_scheduler"),
                "skipped_steps": int(states.get("skipped_steps", 0)),
                "loss_scale": self.loss_scale}

    def close(self) -> None:
        self._files.clear()
        if self._shards is not None:
            self._shards.__exit__(None, None, None)
            self._shards = None
        if self._portable is not None:
            self._portable.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
