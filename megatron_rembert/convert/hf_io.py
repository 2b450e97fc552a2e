"""Checkpoints to and from transformers' RemBERT folders, streamed tensor by tensor."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_rembert.checkpoint.files import (
    SafetensorsWriter,
    StoredTensor,
    safe_open_checked,
    safetensors_entries,
    torch_load_weights,
)
from megatron_rembert.checkpoint.portable import write_portable
from megatron_rembert.checkpoint.reader import CheckpointReader
from megatron_rembert.checkpoint.specs import ParamSpec, param_specs
from megatron_rembert.checkpoint.step_folder import resolve_checkpoint
from megatron_rembert.config import PRESETS, ModelConfig
from megatron_rembert.convert.files import (
    ConvertError,
    check_out_apart,
    check_tp_pp,
    checkpoint_inputs,
    staged_output,
)
from megatron_rembert.convert.hf import (
    HF_FIELDS,
    config_from_hf,
    hf_config_dict,
    hf_names,
    our_names,
)
from megatron_rembert.convert.tensor_check import check_checkpoint, check_tensors
from megatron_rembert.convert.tokenizer_files import check_tokenizer, write_tokenizer
from megatron_rembert.parallel import state
from megatron_rembert.run_config.load import load_config
from megatron_rembert.run_config.schema import Config


def _count(specs: list[ParamSpec]) -> int:
    return sum(int(torch.Size(s.shape).numel()) for s in specs)


def export_hf(checkpoint: str, out: str, tokenizer: str | None, force: bool,
              encoder_only: bool = False, log=print) -> dict:
    """Write a transformers `RemBertForMaskedLM` (or, encoder_only, `RemBertModel`) folder."""
    source = resolve_checkpoint(checkpoint)
    spm_path = tokenizer or source.meta["config"].get("data", {}).get("tokenizer")
    check_out_apart(out, [*checkpoint_inputs("--checkpoint", checkpoint, source.path),
                          ("--tokenizer" if tokenizer else "data.tokenizer", spm_path)])
    with CheckpointReader(source) as reader:
        check_checkpoint(reader)
        model = reader.model
        specs = param_specs(model, 1)
        kept = [s for s in specs if not (encoder_only and s.name.startswith("mlm_head."))]
        if spm_path:
            data = reader.meta["config"].get("data", {})
            check_tokenizer(Path(spm_path), model.vocab_size, reader.meta.get("tokenizer_sha256"),
                            allow_fewer=bool(data.get("allow_larger_vocab", False)))
        else:
            log("no tokenizer given (--tokenizer) or recorded in the checkpoint: writing the "
                "model only")
        by_name = {s.name: s for s in specs}
        entries = [(hf, by_name[name]) for hf, name in hf_names(
            [s.name for s in specs], model, encoder_only)]
        # The fp32 masters where the checkpoint keeps them (a bf16 run's weights are rounded).
        dtypes = {s.name: reader.master_dtype(s) for _, s in entries}
        with staged_output(out, force) as tmp:
            with SafetensorsWriter(tmp / "model.safetensors",
                                   [(n, dtypes[s.name], s.shape) for n, s in entries],
                                   metadata={"format": "pt"}) as writer:
                for name, s in entries:
                    writer.write(name, reader.master_weight(s))
            arch = "RemBertModel" if encoder_only else "RemBertForMaskedLM"
            config = {"architectures": [arch], "model_type": "rembert", **hf_config_dict(model),
                      "dtype": str(next(iter(dtypes.values()))).removeprefix("torch.")}
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            if spm_path:
                write_tokenizer(Path(spm_path), tmp, model.max_position_embeddings)
    before, after = _count(specs), _count(kept)
    if encoder_only:
        log(f"parameters: pre-training model {before:,} -> encoder {after:,} "
            f"(dropped the MLM head and output embedding: {before - after:,})")
    else:
        log(f"parameters: {after:,} written to {out}")
    return {"before": before, "after": after}


# -- transformers -> ours ---------------------------------------------------------------
class _HFWeights:
    """A transformers folder's tensors by name (safetensors, sharded safetensors or .bin):
    `stored` lists them from the headers (or the memory-mapped pickle), `get` reads one."""

    def __init__(self, folder: Path):
        self.stored: dict[str, StoredTensor] = {}
        single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
        self._bin: dict | None = None
        if single.exists():
            files = [single]
        elif index.exists():
            files = self._indexed_files(folder, index)
        elif (folder / "pytorch_model.bin").exists():
            path = folder / "pytorch_model.bin"
            self._bin = torch_load_weights(path)
            if not isinstance(self._bin, dict):
                raise ConvertError(f"{path}: not a state dict (a {type(self._bin).__name__})")
            self.stored = {k: StoredTensor.of(path, str(k), v) for k, v in self._bin.items()}
            return
        else:
            raise ConvertError(f"--model {folder}: no model.safetensors, "
                               "model.safetensors.index.json or pytorch_model.bin")
        for path in files:
            with safe_open_checked(path) as f:
                self.stored.update({t.name: t for t in safetensors_entries(f, path)})

    @staticmethod
    def _indexed_files(folder: Path, index: Path) -> list[Path]:
        """The shards an index names, each inside the model folder (no `..`, no absolute
        path, no symlink out of it)."""
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ConvertError(f"{index}: unreadable ({err})") from err
        files = []
        for name in names:
            path = folder / str(name)
            if not path.resolve().is_relative_to(folder.resolve()):
                raise ConvertError(f"{index}: shard {name!r} lies outside {folder}; a "
                                   "model's files must be inside its folder")
            files.append(path)
        return files

    def get(self, name: str) -> torch.Tensor:
        if self._bin is not None:
            return self._bin[name]
        with safe_open_checked(self.stored[name].file) as f:
            return f.get_tensor(name)


def _preset_name(model: ModelConfig) -> str:
    for name, preset in PRESETS.items():
        if all(getattr(preset, k) == getattr(model, k) for k in HF_FIELDS):
            return name
    # No exact preset: every model field is written out in meta.json anyway, the preset is
    # only the base they override.
    return "rembert"


def import_hf(model_dir: str, out: str, tp: int, pp: int, force: bool,
              config_path: str | None = None, overrides: list[str] = (),
              seed: int | None = None, log=print) -> Path:
    """A transformers RemBERT folder -> a weights-only portable checkpoint (`out/step_00000000`)."""
    folder = Path(model_dir)
    check_out_apart(out, [("--model", folder), ("--config", config_path)])
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ConvertError(f"--model {folder}: no config.json")
    try:
        hf_cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConvertError(f"{cfg_file}: unreadable ({err})") from err
    if not isinstance(hf_cfg, dict):
        raise ConvertError(f"{cfg_file}: not a JSON object")
    if hf_cfg.get("model_type") != "rembert":
        raise ConvertError(f"{cfg_file}: model_type={hf_cfg.get('model_type')!r}, expected "
                           "'rembert'")
    model = config_from_hf(hf_cfg, str(cfg_file))
    if config_path or overrides:
        config = load_config(config_path, list(overrides))
        diff = [k for k in HF_FIELDS if getattr(config.model, k) != getattr(model, k)]
        if diff:
            raise ConvertError(
                f"--config {config_path or '(none)'} --set {list(overrides)}: the model "
                f"differs from {cfg_file} in "
                + ", ".join(f"{k} ({getattr(config.model, k)} vs {getattr(model, k)})"
                            for k in diff))
        model = config.model.replace(**{k: getattr(model, k) for k in HF_FIELDS})
        config.model = model
    else:
        config = Config(model=model, model_preset=_preset_name(model))
    config.parallel.tp, config.parallel.pp = tp, pp
    check_tp_pp(model, tp, pp)
    weights = _HFWeights(folder)
    ours, dropped = our_names(weights.stored, str(folder))
    specs = param_specs(model, 1)
    fresh_head = not any(k.startswith("mlm_head.") for k in ours)
    expected = {s.name: s.shape for s in specs
                if not (fresh_head and s.name.startswith("mlm_head."))}
    hf_label: dict[str, str] = {}
    for hf, name in hf_names(expected, model):
        hf_label.setdefault(name, hf)
    check_tensors({name: weights.stored[hf] for name, hf in ours.items()}, expected,
                  str(cfg_file), label=lambda name: hf_label.get(name, name))
    for name in dropped:
        log(f"{folder}: {name} dropped (the pre-training model has no pooler)")
    head = None
    if fresh_head:
        head = _fresh_head(model, seed if seed is not None else config.train.seed)
        log(f"{folder} holds no MLM head (a RemBertModel): mlm_head.* freshly initialised "
            f"(seed {seed if seed is not None else config.train.seed})")

    def weight(s: ParamSpec) -> torch.Tensor:
        return head[s.name] if s.name not in ours else weights.get(ours[s.name])

    dtypes = {s.name: torch.float32 for s in specs}
    meta = {"config": config.to_dict(), "tokenizer_sha256": None,
            "layout": {"tp": tp, "pp": pp, "dp": None}, "consumed_samples": 0,
            "source": str(folder)}
    with staged_output(out, force) as tmp:
        write_portable(tmp, specs, 0, meta, weight, None, dtypes)
    log(f"wrote {Path(out)} (weights only; step 0): resume with train.save_dir={out}")
    return Path(out)


def _fresh_head(model: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The MLM head as our trainer initialises it (layout-independent, vocabulary stripped)."""
    from megatron_rembert.model.mlm_head import MLMHead
    from megatron_rembert.parallel.layers import init_weights

    with state.offline(1):
        head = MLMHead(model)
        init_weights(head, seed, model.initializer_range, prefix="mlm_head.")
    return {f"mlm_head.{k}": (v[: model.vocab_size] if k.startswith("decoder.") else v)
            for k, v in head.state_dict().items()}
