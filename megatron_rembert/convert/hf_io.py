"""Checkpoints to and from transformers' RemBERT folders, streamed tensor by tensor."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_rembert.checkpoint.files import (
    SafetensorsWriter,
    safe_open_checked,
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
    staged_output,
)
from megatron_rembert.convert.hf import (
    HF_FIELDS,
    config_from_hf,
    hf_config_dict,
    hf_names,
    our_names,
)
from megatron_rembert.convert.tokenizer_files import check_tokenizer, write_tokenizer
from megatron_rembert.parallel import state
from megatron_rembert.run_config import Config, load_config


def _count(specs: list[ParamSpec]) -> int:
    return sum(int(torch.Size(s.shape).numel()) for s in specs)


def export_hf(checkpoint: str, out: str, tokenizer: str | None, force: bool,
              encoder_only: bool = False, log=print) -> dict:
    """Write a transformers `RemBertForMaskedLM` (or, encoder_only, `RemBertModel`) folder."""
    source = resolve_checkpoint(checkpoint)
    with CheckpointReader(source) as reader:
        check_out_apart(out, source.path)
        model = reader.model
        specs = param_specs(model, 1)
        kept = [s for s in specs if not (encoder_only and s.name.startswith("mlm_head."))]
        spm_path = tokenizer or reader.meta["config"].get("data", {}).get("tokenizer")
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
        dtypes = {s.name: reader.weight_dtype(s) for _, s in entries}
        with staged_output(out, force) as tmp:
            with SafetensorsWriter(tmp / "model.safetensors",
                                   [(n, dtypes[s.name], s.shape) for n, s in entries],
                                   metadata={"format": "pt"}) as writer:
                for name, s in entries:
                    writer.write(name, reader.full_weight(s))
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
    """Lazy access to a transformers folder's tensors by name (safetensors or .bin)."""

    def __init__(self, folder: Path):
        self.files: dict[str, Path] = {}
        single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
        if single.exists():
            with safe_open_checked(single) as f:
                self.files = dict.fromkeys(f.keys(), single)
        elif index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError) as err:
                raise ConvertError(f"{index}: unreadable ({err})") from err
            self.files = {k: folder / v for k, v in weight_map.items()}
        elif (folder / "pytorch_model.bin").exists():
            self._bin = torch_load_weights(folder / "pytorch_model.bin")
            self.files = dict.fromkeys(self._bin, folder / "pytorch_model.bin")
        else:
            raise ConvertError(f"--model {folder}: no model.safetensors, "
                               "model.safetensors.index.json or pytorch_model.bin")

    def get(self, name: str) -> torch.Tensor:
        path = self.files[name]
        if path.suffix == ".bin":
            return self._bin[name]
        with safe_open_checked(path) as f:
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
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ConvertError(f"--model {folder}: no config.json")
    try:
        hf_cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConvertError(f"{cfg_file}: unreadable ({err})") from err
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
    ours, dropped = our_names(weights.files, str(folder))
    for name in dropped:
        log(f"{folder}: {name} dropped (the pre-training model has no pooler)")
    specs = param_specs(model, 1)
    head = None
    if not any(k.startswith("mlm_head.") for k in ours):
        head = _fresh_head(model, seed if seed is not None else config.train.seed)
        log(f"{folder} holds no MLM head (a RemBertModel): mlm_head.* freshly initialised "
            f"(seed {seed if seed is not None else config.train.seed})")
    missing = [s.name for s in specs if s.name not in ours and head is None]
    if missing:
        raise ConvertError(f"{folder}: missing tensors for {missing[:5]}")

    def weight(s: ParamSpec) -> torch.Tensor:
        if s.name not in ours:
            return head[s.name]
        t = weights.get(ours[s.name])
        if tuple(t.shape) != s.shape:
            raise ConvertError(f"{weights.files[ours[s.name]]}: {ours[s.name]} has shape "
                               f"{tuple(t.shape)}, {cfg_file} implies {s.shape}")
        return t

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
