"""Training configuration: dataclass sections loaded from YAML, with dotted `--set` overrides.

    model:    a preset name plus any ModelConfig field (`model.preset: rembert`)
    parallel: tp, pp, zero_stage, ds_config (extra DeepSpeed knobs), activation checkpointing
    data:     dataset folder, tokenizer, sequence length, sampling and masking
    optim:    optimizer and learning-rate schedule
    train:    batch sizes, precision, steps, logging, checkpoints

Every number lives here once; `training.ds_config` writes batch sizes, precision, ZeRO stage,
optimizer and clipping into the DeepSpeed config dict.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_rembert.config import ConfigError, ModelConfig, get_preset


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel size (ranks adjacent, one node)
    pp: int = 1  # pipeline stages; > 1 runs DeepSpeed's PipelineModule (1F1B)
    zero_stage: int = 1  # ZeRO stage 1 or 2; 0 only for fp32 with pp = 1; pp > 1 needs 1
    ds_config: str = ""  # JSON with further DeepSpeed knobs (buckets, loss scaler); optional
    activation_checkpointing: bool = False  # recompute each Transformer layer in backward
    # A collective waiting longer than this fails, naming each rank's step and instruction
    timeout_minutes: float = 10.0
    # auto: nccl on GPUs, gloo on CPUs; gloo on GPUs lets several ranks share one GPU (checks)
    backend: str = "auto"


@dataclass
class DataConfig:
    path: str = ""  # dataset folder with manifest.json (data_tools/preprocess.py)
    tokenizer: str = ""  # the SentencePiece .model the dataset was made with
    seq_length: int = 512
    alpha: float = 0.5  # language sampling exponent (paper: 0.5)
    mask_prob: float = 0.15
    whole_word_mask: bool = False
    max_predictions: int = 0  # P, masked slots per sequence; 0 = derived from seq_length
    num_workers: int = 1


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | lamb (training/lamb.py: whole-parameter trust ratios)
    lr: float = 2e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    weight_decay: float = 0.01
    warmup_steps: int = 15_000
    decay: str = "linear"  # linear | cosine | constant, after warm-up, to min_lr at train.steps
    min_lr: float = 0.0
    clip_grad: float = 1.0


@dataclass
class TrainConfig:
    steps: int = 1_760_000
    micro_batch_size: int = 8
    global_batch_size: int = 2048  # = micro_batch_size x gradient accumulation x DP
    precision: str = "bf16"  # fp32 | bf16 | fp16; bf16 and fp16 need ZeRO stage 1 or 2
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 1000  # 0 = never
    eval_batches: int = 10
    save_interval: int = 1000  # 0 = only at the end and on a signal
    keep_last: int = 3
    save_dir: str = "runs/checkpoints"
    # Roll back: resume from this step_* folder of save_dir; newer ones are moved aside.
    resume_from: str = ""
    log_dir: str = "runs/logs"
    max_nonfinite_steps: int = 10  # stop after this many non-finite losses in a row


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    model_preset: str = "rembert"

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["model"] = {"preset": self.model_preset, **out["model"]}
        del out["model_preset"]
        return out


_SECTIONS = {f.name: f for f in dataclasses.fields(Config) if f.name != "model_preset"}


def _coerce(value, annotation, key: str):
    """Check a YAML value against a field's type; ints are accepted for floats."""
    kind = {"int": int, "float": float, "str": str, "bool": bool}[annotation]
    if kind is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:  # YAML reads "1e-3" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if (kind is not bool and isinstance(value, bool)) or not isinstance(value, kind):
        raise ConfigError(f"{key}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _set_field(section_obj, section: str, name: str, value) -> None:
    fields = {f.name: f for f in dataclasses.fields(section_obj)}
    if name not in fields:
        raise ConfigError(f"unknown key {section}.{name}; known keys: "
                          + ", ".join(f"{section}.{k}" for k in sorted(fields)))
    # With postponed annotations the field types are the strings "int", "float", "str", "bool".
    setattr(section_obj, name, _coerce(value, fields[name].type, f"{section}.{name}"))


def build_config(raw: dict, overrides: list[str] = ()) -> Config:
    """A Config from a parsed YAML dict plus `section.key=value` overrides (later wins)."""
    raw = {k: dict(v or {}) for k, v in (raw or {}).items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. train.steps=20")
        key, text = item.split("=", 1)
        if key.count(".") != 1:
            raise ConfigError(f"--set {key}: expected SECTION.KEY, e.g. parallel.tp=2")
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = yaml.safe_load(text) if text else ""
    unknown = set(raw) - set(_SECTIONS)
    if unknown:
        raise ConfigError(f"unknown config section(s) {sorted(unknown)}; expected "
                          f"{sorted(_SECTIONS)}")
    model_raw = raw.pop("model", {})
    preset = model_raw.pop("preset", "rembert")
    config = Config(model=get_preset(preset), model_preset=preset)
    for name, value in model_raw.items():
        _set_field(config.model, "model", name, value)
    for section, values in raw.items():
        for name, value in values.items():
            _set_field(getattr(config, section), section, name, value)
    return config


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    raw = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return build_config(raw, overrides)


def config_help() -> str:
    """Every key with its default, for `train.py --help`."""
    lines = ["config keys (section.key, default):", "  model.preset = rembert  (one of the "
             "presets in megatron_rembert/config.py; other model.* keys override it)"]
    default = Config()
    for section in _SECTIONS:
        values = getattr(default, section)
        notes = _field_notes(type(values))
        for f in dataclasses.fields(values):
            note = f"  ({notes[f.name]})" if f.name in notes else ""
            lines.append(f"  {section}.{f.name} = {getattr(values, f.name)}{note}")
    return "\n".join(lines)


def _field_notes(cls) -> dict[str, str]:
    """Each field's comment in the dataclass source (inline, or the lines just above it),
    which `--help` prints."""
    notes, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        comment = re.match(r"\s+#\s*(.+)$", line)
        if comment:
            above.append(comment.group(1))
            continue
        match = re.match(r"\s+(\w+): [^=]+=[^#]*(?:#\s*(.+))?$", line)
        if match and (match.group(2) or above):
            notes[match.group(1)] = match.group(2) or " ".join(above)
        above = []
    return notes


def validate_config(config: Config, world_size: int) -> int:
    """Check everything that can be checked before any heavy work; returns the DP size."""
    par, train, optim = config.parallel, config.train, config.optim
    if par.tp < 1 or par.pp < 1 or world_size % (par.tp * par.pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tp x parallel.pp = "
            f"{par.tp} x {par.pp}; change the number of processes or the layout")
    dp = world_size // (par.tp * par.pp)
    config.model.validate(par.tp)
    if config.model.num_hidden_layers < par.pp:
        raise ConfigError(f"model.num_hidden_layers={config.model.num_hidden_layers} is fewer "
                          f"than parallel.pp={par.pp} pipeline stages")
    if par.pp > 1 and config.model.tie_embeddings:
        raise ConfigError("model.tie_embeddings=true needs parallel.pp=1: the tied table would "
                          "span the first and last pipeline stages")
    if par.backend not in ("auto", "nccl", "gloo"):
        raise ConfigError(f"parallel.backend={par.backend!r}: expected auto, nccl or gloo")
    if not par.timeout_minutes > 0:
        raise ConfigError(f"parallel.timeout_minutes={par.timeout_minutes}: must be > 0")
    if par.zero_stage not in (0, 1, 2):
        raise ConfigError(f"parallel.zero_stage={par.zero_stage}: expected 0, 1 or 2")
    if par.pp > 1 and par.zero_stage != 1:
        # Stage 2 is not supported by DeepSpeed's pipeline engine. Without ZeRO, its gradient
        # clipping counts a replicated parameter only on the first rank of the tp x pp group,
        # so the later stages' LayerNorms and biases drop out of the norm and training differs
        # from one process (ZeRO-1 computes the norm right; tests/training/test_layouts.py).
        raise ConfigError(f"parallel.zero_stage={par.zero_stage} with parallel.pp={par.pp}: "
                          "pipeline parallelism needs zero_stage=1 (DeepSpeed's pipeline "
                          "engine has no ZeRO-2, and clips gradients wrongly without ZeRO)")
    per_step = train.micro_batch_size * dp
    if train.micro_batch_size < 1 or train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} is not a multiple of "
            f"train.micro_batch_size x DP = {train.micro_batch_size} x {dp}")
    if train.precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"train.precision={train.precision!r}: expected fp32, bf16 or fp16")
    if train.precision != "fp32" and par.zero_stage == 0:
        # DeepSpeed (0.19) without ZeRO: bf16 cannot keep fp32 gradient accumulation, and its
        # fp16 wrapper does not multiply the loss by the loss scale in engine.backward yet
        # divides the gradients by it, takes one Adam step on zero gradients when built, and
        # leaves tensor-parallel shards out of the clipping norm. The ZeRO optimizers have none
        # of these faults (tests/training/test_fp16.py compares fp16 with fp32).
        raise ConfigError(f"train.precision={train.precision} needs parallel.zero_stage=1 or 2 "
                          "(DeepSpeed keeps fp32 master weights, gradients and a correct loss "
                          "scale only in its ZeRO optimizers); zero_stage=0 is for fp32")
    if optim.name not in ("adamw", "lamb"):
        raise ConfigError(f"optim.name={optim.name!r}: expected adamw or lamb")
    if optim.decay not in ("linear", "cosine", "constant"):
        raise ConfigError(f"optim.decay={optim.decay!r}: expected linear, cosine or constant")
    if train.steps < 1:
        raise ConfigError(f"train.steps={train.steps}: must be >= 1")
    if config.data.seq_length > config.model.max_position_embeddings:
        raise ConfigError(
            f"data.seq_length={config.data.seq_length} exceeds "
            f"model.max_position_embeddings={config.model.max_position_embeddings}")
    return dp
