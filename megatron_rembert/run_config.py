"""Training configuration: dataclass sections loaded from YAML, with dotted `--set` overrides.

    model:    a preset name plus any ModelConfig field (`model.preset: rembert`)
    parallel: tp, pp, zero_stage, ds_config (extra DeepSpeed knobs), activation checkpointing
    data:     dataset folder, tokenizer, sequence length, sampling and masking, their schedules
    optim:    optimizer and learning-rate schedule
    train:    batch sizes, precision, steps, logging, checkpoints
    eval:     the per-language validation set, retrieval on held-out parallel text

Every default lives in its dataclass, every allowed value in RANGES or CHOICES, and every
check that needs no world size in `check_settings`; `training.optim.deepspeed_config` writes
batch sizes, precision, ZeRO stage, optimizer and clipping into the DeepSpeed config dict.
What follows from the checked config and the world size (layout, stage split, P and the mask
rates, schedules) is resolved once into a `training.plan.RunPlan`.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from megatron_rembert.config import (
    AT_LEAST_0,
    AT_LEAST_1,
    MODEL_CHOICES,
    MODEL_RANGES,
    POSITIVE,
    PROBABILITY,
    ConfigError,
    ModelConfig,
    Range,
    check_buildable,
    check_choice,
    choice_text,
    get_preset,
)
from megatron_rembert.data.config import DataConfig
from megatron_rembert.fs import unwritable_reason

if TYPE_CHECKING:
    from megatron_rembert.data.schedule import DataPlan


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel size (ranks adjacent, one node)
    pp: int = 1  # pipeline stages; > 1 runs DeepSpeed's PipelineModule (1F1B)
    zero_stage: int = 1  # ZeRO stage 1 or 2; 0 only for fp32 with pp = 1; pp > 1 needs 1
    ds_config: str = ""  # JSON with further DeepSpeed knobs (buckets, loss scaler); optional
    activation_checkpointing: bool = False  # recompute each Transformer layer in backward
    # Each pipeline stage's estimated memory per rank stays under this many GiB (0 = no cap);
    # within it, stages are balanced by FLOPs (`--dry-run` prints the split)
    stage_memory_gib: float = 0.0
    # Refuse to start when --dry-run's memory estimate per rank exceeds the machine's memory
    # per rank (GPU memory on CUDA; host RAM on CPU, shared by the node's ranks); false: start
    # anyway (the estimate is off for your setup)
    memory_check: bool = True
    # A collective waiting longer than this fails, naming each rank's step and instruction
    timeout_minutes: float = 10.0
    # auto: nccl on GPUs, gloo on CPUs; gloo on GPUs lets several ranks share one GPU (checks;
    # not with pp > 1: gloo sends CPU tensors only)
    backend: str = "auto"


@dataclass
class OptimConfig:
    name: str = "adamw"  # lamb: training/lamb.py, whole-parameter trust ratios
    lr: float = 2e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    weight_decay: float = 0.01
    warmup_steps: int = 15_000
    # from decay_start_step to min_lr at train.steps
    decay: str = "linear"
    # 0 = right after warm-up; later: warmup-stable-decay, lr held until this step
    decay_start_step: int = 0
    min_lr: float = 0.0  # at most lr
    clip_grad: float = 1.0  # global gradient-norm limit; 0 = no clipping


@dataclass
class TrainConfig:
    steps: int = 1_760_000
    micro_batch_size: int = 8
    global_batch_size: int = 2048  # = micro_batch_size x gradient accumulation x DP
    precision: str = "bf16"  # bf16 and fp16 need ZeRO stage 1 or 2
    # The Transformer layers' linears multiply in fp8 (parallel/fp8.py); weights, optimizer and
    # checkpoints stay train.precision's. Needs compute capability >= 8.9 on CUDA and hidden
    # and FFN sizes / tp in multiples of 16; a checkpoint resumes with it on or off
    fp8: bool = False
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 1000  # validation (and eval.retrieval_path's retrieval); 0 = never
    # at most this many global batches of validation per language (see eval.*)
    eval_batches: int = 10
    save_interval: int = 1000  # 0 = only at the end and on a signal
    # Save and exit 0 at the first step boundary this many minutes after the process started
    # (0 = off), as a stop signal does; `latest` names that step and the run resumes from it.
    # Set it below the job's wall-time limit by a step and a save; the schedules stay by steps
    max_minutes: float = 0.0
    keep_last: int = 3
    save_dir: str = "runs/checkpoints"
    # Roll back: resume from this step_* folder of save_dir; newer ones are moved aside.
    resume_from: str = ""
    log_dir: str = "runs/logs"
    # An applied step with a non-finite loss or gradient norm stops the run at once; steps
    # whose update was skipped for a non-finite gradient norm (weights untouched; never
    # saved) stop it after this many in a row, or when the run ends on one
    max_nonfinite_steps: int = 10
    # Stop when a step's loss exceeds this factor times the mean of the last
    # train.divergence_window losses (0 = off, else above 1). 10 fires only on a broken model:
    # late in training 10x the mean is worse than guessing uniformly, early it is far beyond
    # any spike of a healthy run
    divergence_factor: float = 10.0
    # Losses in train.divergence_factor's mean; the check waits until this many steps
    # have run (after a resume too: the window is not saved)
    divergence_window: int = 100
    # Save (and move `latest`) only when every weight is finite and at most this in magnitude:
    # trained weights stay within tens, a diverging run's grow without bound
    max_weight_abs: float = 1e4
    # Weights & Biases project ("" = off; wandb is imported only when set; WANDB_MODE=offline
    # logs into train.log_dir/wandb without a network)
    wandb_project: str = ""


@dataclass
class EvalConfig:
    # validation sequences per language (fewer where a language has fewer), a fixed set
    sequences_per_language: int = 256
    mask_prob: float = 0.15  # validation mask rate, whatever the training schedule says
    # Folder of held-out parallel text, <lang>.jsonl ({"text": ..., "en": ...} per line) or
    # <lang>.tsv (text TAB English): with each validation, retrieval accuracy@1 to and from
    # English per language ("" = off; needs data.tokenizer and parallel.pp = 1)
    retrieval_path: str = ""
    # pairs per language: a fixed subset of larger sets, duplicates dropped (the pairs that
    # rembert-eval --max-pairs picks at the same number)
    retrieval_pairs: int = 200
    # Transformer layer whose output is mean-pooled, 1..model.num_hidden_layers; 0 = the
    # middle one, (num_hidden_layers + 1) // 2 (rembert-eval's default layer too)
    retrieval_layer: int = 0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    model_preset: str = "rembert"

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["model"] = {"preset": self.model_preset, **out["model"]}
        del out["model_preset"]
        return out


_SECTIONS = {f.name: f for f in dataclasses.fields(Config) if f.name != "model_preset"}

# Every numeric setting and the values it may take (all finite), checked by check_ranges and
# shown by `train.py --help`. Settings that depend on each other are checked in check_settings.
RANGES: dict[str, Range] = {
    **{f"model.{name}": allowed for name, allowed in MODEL_RANGES.items()},
    "parallel.tp": AT_LEAST_1,
    "parallel.pp": AT_LEAST_1,
    "parallel.zero_stage": Range(0, 2),
    "parallel.timeout_minutes": POSITIVE,
    "parallel.stage_memory_gib": AT_LEAST_0,
    "data.seq_length": Range(3),  # [CLS], one token, [SEP]
    "data.alpha": Range(0.0, 1.0),
    "data.mask_prob": Range(0.0, 1.0, low_open=True, high_open=True),
    "data.max_predictions": AT_LEAST_0,  # and <= data.seq_length
    "data.num_workers": AT_LEAST_0,
    "optim.lr": POSITIVE,
    "optim.beta1": PROBABILITY,
    "optim.beta2": PROBABILITY,
    "optim.eps": POSITIVE,
    "optim.weight_decay": AT_LEAST_0,
    "optim.warmup_steps": AT_LEAST_0,
    "optim.decay_start_step": AT_LEAST_0,  # and < train.steps
    "optim.min_lr": AT_LEAST_0,  # and <= optim.lr
    "optim.clip_grad": AT_LEAST_0,
    "train.steps": AT_LEAST_1,
    "train.micro_batch_size": AT_LEAST_1,
    "train.global_batch_size": AT_LEAST_1,
    "train.seed": Range(0, 2**32 - 1),  # numpy's seed range
    "train.log_interval": AT_LEAST_1,
    "train.eval_interval": AT_LEAST_0,
    "train.eval_batches": AT_LEAST_1,
    "train.save_interval": AT_LEAST_0,
    "train.max_minutes": AT_LEAST_0,
    "train.keep_last": AT_LEAST_1,
    "train.max_nonfinite_steps": AT_LEAST_1,
    "train.divergence_factor": AT_LEAST_0,  # 0 (off) or above 1
    "train.divergence_window": AT_LEAST_1,
    "train.max_weight_abs": POSITIVE,
    "eval.sequences_per_language": AT_LEAST_1,
    "eval.mask_prob": Range(0.0, 1.0, low_open=True, high_open=True),
    "eval.retrieval_pairs": Range(2),  # one pair would always be found
    "eval.retrieval_layer": AT_LEAST_0,  # and <= model.num_hidden_layers
}

# Every setting that takes one of a few values, and those values: checked by check_ranges,
# shown by `train.py --help`.
CHOICES: dict[str, tuple] = {
    **{f"model.{name}": allowed for name, allowed in MODEL_CHOICES.items()},
    "parallel.backend": ("auto", "nccl", "gloo"),
    "data.mask_schedule": ("step", "linear"),
    "optim.name": ("adamw", "lamb"),
    "optim.decay": ("linear", "cosine", "1-sqrt", "constant"),
    "train.precision": ("fp32", "bf16", "fp16"),
}

# The ZeRO stage pipeline parallelism needs: DeepSpeed's pipeline engine has no ZeRO-2, and
# without ZeRO its gradient clipping counts a replicated parameter only on the first rank of
# the tp x pp group, so the later stages' LayerNorms and biases drop out of the norm and
# training differs from one process (ZeRO-1 computes the norm right;
# tests/training/test_layouts.py). Checked here; `convert reshard` writes it for pp > 1.
PIPELINE_ZERO_STAGE = 1


def check_ranges(config: Config) -> None:
    """Every numeric setting finite and in its range (RANGES), every choice one of its values
    (CHOICES), the schedules well formed; naming the key if not."""
    for key, allowed in RANGES.items():
        section, name = key.split(".")
        allowed.check(key, getattr(getattr(config, section), name))
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        check_choice(key, getattr(getattr(config, section), name), allowed)
    if config.data.max_predictions > config.data.seq_length:
        raise ConfigError(f"data.max_predictions={config.data.max_predictions} exceeds "
                          f"data.seq_length={config.data.seq_length}")
    if config.optim.min_lr > config.optim.lr:
        raise ConfigError(f"optim.min_lr={config.optim.min_lr} exceeds "
                          f"optim.lr={config.optim.lr}")
    factor = config.train.divergence_factor
    if 0 < factor <= 1:
        raise ConfigError(f"train.divergence_factor={factor}: 0 (off) or above 1 (a loss "
                          "this many times its recent mean stops the run)")
    check_schedule(config)


def check_schedule(config: Config) -> None:
    """The data schedules and the LR's decay start, each problem one line naming the key.
    Language names are checked against the dataset at start-up (training.inputs.check_inputs),
    P against the largest mask rate where it is derived (data.schedule.DataPlan.resolve)."""
    data, steps = config.data, config.train.steps
    starts = data.phase_starts
    if starts and starts[0] != 0.0:
        raise ConfigError(f"data.phase_starts={starts}: the first phase must start at 0.0")
    for a, b in zip(starts, starts[1:], strict=False):
        if not a < b:
            raise ConfigError(f"data.phase_starts={starts}: phases out of order ({a} then {b}); "
                              "give increasing fractions of train.steps")
    if starts and not starts[-1] <= 1.0:
        raise ConfigError(f"data.phase_starts={starts}: fractions of train.steps, at most 1.0")
    for key, allowed in (("phase_alpha", RANGES["data.alpha"]),
                         ("phase_mask_prob", RANGES["data.mask_prob"])):
        values = getattr(data, key)
        if values and len(values) != len(starts):
            raise ConfigError(f"data.{key} has {len(values)} values, data.phase_starts "
                              f"{len(starts)}: give one per phase")
        for v in values:
            if v not in allowed:
                raise ConfigError(f"data.{key}={values}: {v} is not in {allowed}")
    for lang, f in data.language_start.items():
        if not 0.0 <= f < 1.0:
            raise ConfigError(f"data.language_start.{lang}={f}: a fraction of train.steps in "
                              "[0, 1)")
    if config.optim.decay_start_step and not (
            config.optim.warmup_steps <= config.optim.decay_start_step < steps):
        raise ConfigError(f"optim.decay_start_step={config.optim.decay_start_step}: must be in "
                          f"[optim.warmup_steps={config.optim.warmup_steps}, train.steps={steps})"
                          " (0: decay right after warm-up)")


def check_paths(config: Config) -> None:
    """train.save_dir and train.log_dir: a folder, or one that can be made, and writable."""
    for key in ("train.save_dir", "train.log_dir"):
        text = getattr(config.train, key.split(".")[1])
        if not text:
            raise ConfigError(f"{key} is empty: set it to a folder")
        reason = unwritable_reason(text)
        if reason:
            raise ConfigError(f"{key}={text}: {reason}; point {key} at a writable folder")


def check_config(config: Config) -> DataPlan:
    """Every check that needs neither the world size nor the file system: ranges and
    choices, whether the model can be built at parallel.tp x parallel.pp, the settings that
    depend on each other. Returns the data plan resolved on the way (schedules, the largest
    mask rate, P), which checks data.max_predictions against that rate."""
    check_ranges(config)
    par, train = config.parallel, config.train
    check_buildable(config.model, par.tp, par.pp)
    if par.pp > 1 and par.zero_stage != PIPELINE_ZERO_STAGE:
        raise ConfigError(f"parallel.zero_stage={par.zero_stage} with parallel.pp={par.pp}: "
                          f"pipeline parallelism needs zero_stage={PIPELINE_ZERO_STAGE} "
                          "(DeepSpeed's pipeline engine has no ZeRO-2, and clips gradients "
                          "wrongly without ZeRO)")
    if train.precision != "fp32" and par.zero_stage == 0:
        # DeepSpeed (0.19) without ZeRO: bf16 cannot keep fp32 gradient accumulation, and its
        # fp16 wrapper does not multiply the loss by the loss scale in engine.backward yet
        # divides the gradients by it, takes one Adam step on zero gradients when built, and
        # leaves tensor-parallel shards out of the clipping norm. The ZeRO optimizers have none
        # of these faults (tests/training/test_fp16.py compares fp16 with fp32).
        raise ConfigError(f"train.precision={train.precision} needs parallel.zero_stage=1 or 2 "
                          "(DeepSpeed keeps fp32 master weights, gradients and a correct loss "
                          "scale only in its ZeRO optimizers); zero_stage=0 is for fp32")
    if train.fp8:
        check_fp8(config)
    if config.eval.retrieval_path:
        check_retrieval(config)
    if config.data.seq_length > config.model.max_position_embeddings:
        raise ConfigError(
            f"data.seq_length={config.data.seq_length} exceeds "
            f"model.max_position_embeddings={config.model.max_position_embeddings}")
    from megatron_rembert.data.schedule import DataPlan  # numpy: not for --help

    return DataPlan.resolve(config.data, train.steps, config.eval.mask_prob)


def check_settings(config: Config) -> DataPlan:
    """Every check that needs no world size: `check_config`, and the paths (train.save_dir
    and train.log_dir writable, eval.retrieval_path's files readable). What train.py runs
    before any heavy import; returns `check_config`'s data plan, for the run plan
    (`RunPlan.build(..., data=)`)."""
    data = check_config(config)
    check_paths(config)
    if config.eval.retrieval_path:
        from megatron_rembert.data.parallel_text import read_parallel_set

        read_parallel_set(config.eval.retrieval_path, config.eval.retrieval_pairs)
    return data


def check_retrieval(config: Config) -> None:
    """eval.retrieval_*: what the periodic retrieval (training/retrieval.py) needs."""
    path, layers = config.eval.retrieval_path, config.model.num_hidden_layers
    if config.parallel.pp > 1:
        # The pooled layer lives on one pipeline stage: measuring it would take a forward
        # of our own through the stages beside DeepSpeed's schedule, for what the saved
        # checkpoints give offline at any layout.
        raise ConfigError(f"eval.retrieval_path={path} with parallel.pp={config.parallel.pp}: "
                          "retrieval during training needs pp = 1; leave eval.retrieval_path "
                          "empty and evaluate the saved checkpoints with rembert-eval")
    if not config.data.tokenizer:
        raise ConfigError(f"eval.retrieval_path={path} needs data.tokenizer (the run's "
                          "SentencePiece model encodes the sentences)")
    if not config.train.eval_interval:
        raise ConfigError(f"eval.retrieval_path={path} with train.eval_interval=0: retrieval "
                          "runs with the validation; set train.eval_interval")
    if config.eval.retrieval_layer > layers:
        raise ConfigError(f"eval.retrieval_layer={config.eval.retrieval_layer} exceeds "
                          f"model.num_hidden_layers={layers} (0 = the middle layer)")


def _coerce(value, annotation, key: str):
    """Check a YAML value against a field's type; ints are accepted for floats. Lists
    (`list[float]`) and mappings (`dict[str, float]`) are checked element by element."""
    if annotation.startswith("list["):
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, e.g. [0.0, 0.5], got {value!r}")
        return [_coerce(v, annotation[5:-1], key) for v in value]
    if annotation.startswith("dict[str, "):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, e.g. {{sw: 0.5}}, got {value!r}")
        return {str(k): _coerce(v, annotation[10:-1], f"{key}.{k}") for k, v in value.items()}
    if " | " in annotation:  # e.g. "bool | str" (model.compile: true, false or auto)
        for alternative in annotation.split(" | "):
            try:
                return _coerce(value, alternative, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {' or '.join(annotation.split(' | '))}, "
                          f"got {value!r}")
    kind = {"int": int, "float": float, "str": str, "bool": bool}[annotation]
    if kind is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:  # YAML reads "1e-3" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if (kind is not bool and isinstance(value, bool)) or not isinstance(value, kind):
        hint = f" (quote it in YAML: '{value}')" if kind is str else ""
        raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}{hint}")
    return value


def _did_you_mean(name: str, choices, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def _section_fields(section: str) -> dict:
    """The fields of a config section (model.preset included), by name."""
    fields = {f.name: f for f in dataclasses.fields(_SECTIONS[section].default_factory())}
    return {"preset": None, **fields} if section == "model" else fields


def _set_field(section_obj, section: str, name: str, value) -> None:
    fields = {f.name: f for f in dataclasses.fields(section_obj)}
    if name not in fields:
        hint = _did_you_mean(name, _section_fields(section), f"{section}.")
        raise ConfigError(f"unknown key {section}.{name}{hint} (train.py --help lists every key)")
    # With postponed annotations the field types are the strings "int", "float", "str", "bool".
    setattr(section_obj, name, _coerce(value, fields[name].type, f"{section}.{name}"))


class _PlainLoader(yaml.SafeLoader):
    """safe_load without aliases: an alias (`*name`) repeats an anchored node by reference, so
    a few lines can stand for billions of values (the "billion laughs"), which anything that
    walks or prints the result (a type check, an error message) expands until memory runs
    out. A config never needs one; refused where it is read, with the line it is on."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "a YAML alias (*name): anchors and aliases are not allowed in a "
                "config (write the value out)", self.peek_event().start_mark)
        return super().compose_node(parent, index)


def _plain_yaml(text: str):
    return yaml.load(text, Loader=_PlainLoader)  # noqa: S506 - a SafeLoader subclass


def _override_value(section: str, name: str, text: str):
    """The value of `--set section.name=text`: the text itself for a string key (a folder
    named 2024 stays "2024"), else a YAML scalar (numbers, true/false)."""
    fields = _section_fields(section) if section in _SECTIONS else {}
    if (section, name) == ("model", "preset") or getattr(fields.get(name), "type", None) == "str":
        return text
    try:
        return _plain_yaml(text) if text else ""
    except yaml.composer.ComposerError as err:
        raise ConfigError(f"--set {section}.{name}: {err.problem}") from None
    except yaml.YAMLError:
        return text  # not a YAML scalar: kept as text; the key's type check names it


def build_config(raw: dict, overrides: list[str] = ()) -> Config:
    """A Config from a parsed YAML dict plus `section.key=value` overrides (later wins)."""
    _check_sections(raw or {}, "config")
    raw = {k: dict(v or {}) for k, v in (raw or {}).items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. train.steps=20")
        key, text = item.split("=", 1)
        if key.count(".") != 1:
            raise ConfigError(f"--set {key}: expected SECTION.KEY, e.g. parallel.tp=2")
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = _override_value(section, name, text)
    unknown = sorted(set(raw) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"unknown config section {unknown[0]!r}"
                          f"{_did_you_mean(unknown[0], _SECTIONS)}; expected one of "
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
        raw = _read_yaml(path) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
        _check_sections(raw, str(path))
    return build_config(raw, overrides)


def _check_sections(raw: dict, source: str) -> None:
    for section, values in raw.items():
        if values is not None and not isinstance(values, dict):
            raise ConfigError(f"{source}: section {section!r} must be a mapping of keys, "
                              f"got {values!r}")


def _read_yaml(path: Path):
    """Plain YAML only (safe_load: no `!!python/...` tags; no aliases: `_PlainLoader`); any
    problem is one line naming the file and line."""
    try:
        return _plain_yaml(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        if "python/" in problem:
            problem = ("a !!python tag, which would build Python objects; only plain values, "
                       "lists and mappings are allowed")
        raise ConfigError(f"{path}{where}: not a valid config: {problem}") from None


def config_help() -> str:
    """Every key with its default and the values it may take, for `train.py --help`."""
    lines = ["config keys (section.key = default, allowed values; numbers must be finite):",
             "  model.preset = rembert  (one of the presets in megatron_rembert/config.py; "
             "other model.* keys override it)"]
    default = Config()
    for section in _SECTIONS:
        values = getattr(default, section)
        notes = _field_notes(type(values))
        for f in dataclasses.fields(values):
            key = f"{section}.{f.name}"
            allowed = (f"  {RANGES[key]}" if key in RANGES else
                       f"  {' | '.join(map(choice_text, CHOICES[key]))}" if key in CHOICES
                       else "")
            note = f"  ({notes[f.name]})" if f.name in notes else ""
            lines.append(f"  {key} = {getattr(values, f.name)}{allowed}{note}")
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


def check_fp8(config: Config) -> None:
    """train.fp8: every Transformer linear's local GEMM in multiples of 16, and a GPU (if any)
    with fp8 tensor cores (compute capability 8.9: Ada, Hopper and later)."""
    from megatron_rembert.kernels.fp8 import GEMM_MULTIPLE

    model, tp = config.model, config.parallel.tp
    for key, size in (("model.hidden_size", model.hidden_size),
                      ("model.intermediate_size", model.intermediate_size)):
        if size % (GEMM_MULTIPLE * tp):
            raise ConfigError(f"train.fp8=true needs {key} / parallel.tp in multiples of "
                              f"{GEMM_MULTIPLE} (fp8 GEMMs), got {size} / {tp}; set "
                              "train.fp8=false or change the size")
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        raise ConfigError(f"train.fp8=true needs a GPU of compute capability >= 8.9 (Ada, "
                          f"Hopper or later); {torch.cuda.get_device_name()} has "
                          f"{major}.{minor}: set train.fp8=false")
