"""The encoder under evaluation: where it comes from, its tokenizer, its weights, step 0.

`open_checkpoint` / `open_hf` read only what is cheap (meta.json or config.json, the tensor
headers, the tokenizer) and check it, so bad input fails before any weight is loaded;
`ModelSource.load_encoder` then builds our one-process `RemBertModel` in fp32. A training
checkpoint of any layout and precision is read as full tensors through
`checkpoint.reader.CheckpointReader` (what `rembert-convert to-hf` reads); a transformers folder
(`to-hf` or `export-encoder` output) through safetensors only, names mapped by
`convert.hf.our_names`: nothing is unpickled. `step0_encoder` is the same architecture as the
trainer initialises it, never trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rembert.checkpoint.files import safe_open_checked, safetensors_entries
from megatron_rembert.checkpoint.reader import CheckpointReader, model_config
from megatron_rembert.checkpoint.specs import param_specs, shard
from megatron_rembert.checkpoint.step_folder import resolve_checkpoint
from megatron_rembert.config import ModelConfig
from megatron_rembert.convert.hf import config_from_hf, from_hf_state_dict, our_names
from megatron_rembert.convert.tensor_check import check_checkpoint, check_tensors
from megatron_rembert.data.common import SpecialIds
from megatron_rembert.errors import UserError
from megatron_rembert.fs import sha256_file
from megatron_rembert.model.rembert import RemBertModel
from megatron_rembert.parallel import state
from megatron_rembert.parallel.layers import init_weights
from megatron_rembert.run_config.schema import TrainConfig

ENCODER_PREFIX = "rembert."  # our pre-training model's names of the encoder's weights


class EvalModelError(UserError):
    """A model, checkpoint or tokenizer the evaluation cannot use; names the file or flag."""


class Tokenizer:
    """SentencePiece ids framed as the pre-training rows are (prep/packing.py):
    `[CLS] pieces [SEP]`, cut to `max_length` tokens."""

    def __init__(self, path: Path, sp, special: SpecialIds):
        self.path, self.sp, self.special = path, sp, special
        self.sha256 = sha256_file(path)

    def pieces(self, texts: list[str]) -> list[list[int]]:
        """The texts' piece ids, without [CLS] and [SEP]."""
        return [list(ids) for ids in self.sp.encode(texts)]

    def encode(self, texts: list[str], max_length: int) -> list[list[int]]:
        return [self.special.framed(ids, max_length) for ids in self.pieces(texts)]


def load_tokenizer(path: Path, flag: str, vocab_size: int, expected_sha: str | None,
                   allow_fewer: bool) -> Tokenizer:
    from megatron_rembert.data.common import DataError
    from megatron_rembert.prep.tokenizer import check_special_ids, load_sentencepiece

    if not path.is_file():
        raise EvalModelError(f"{flag} {path}: no such file; pass the tokenizer with "
                             "--tokenizer")
    if expected_sha and sha256_file(path) != expected_sha:
        raise EvalModelError(f"{flag} {path}: its sha256 differs from the tokenizer the "
                             "checkpoint was trained with (meta.json tokenizer_sha256); pass "
                             "the training tokenizer")
    try:
        sp = load_sentencepiece(path)
        special = check_special_ids(sp, path)
    except DataError as err:
        raise EvalModelError(f"{flag} {err}") from err
    size = sp.get_piece_size()
    if size > vocab_size or (size < vocab_size and not allow_fewer):
        raise EvalModelError(f"{flag} {path}: {size} pieces, the model's vocab_size is "
                             f"{vocab_size}")
    return Tokenizer(path, sp, special)


@dataclass
class ModelSource:
    """A model to evaluate, checked but not loaded."""

    kind: str  # "checkpoint" or "hf"
    path: Path  # the step folder, or the transformers folder
    config: ModelConfig  # as built for evaluation (eager, fp32-friendly execution fields)
    step: int | None  # the checkpoint's step (None for a transformers folder)
    seed: int  # train.seed of the run: the step-0 model's
    tokenizer: Tokenizer

    def load_encoder(self) -> RemBertModel:
        """Our RemBertModel (no pooler) with the source's weights, fp32, eval mode, CPU."""
        weights = (_checkpoint_weights(self.path) if self.kind == "checkpoint"
                   else _hf_weights(self.path, self.config))
        model = build_encoder(self.config)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if missing or unexpected:  # the tensor checks passed: this is a mapping bug
            raise RuntimeError(f"encoder weights do not fit: missing {missing}, "
                               f"unexpected {unexpected}")
        return model.eval()


def _eval_config(model: ModelConfig) -> ModelConfig:
    # Eager layers: texts come in many lengths, a compiled graph would recompile per shape.
    return model.replace(compile=False)


def build_encoder(config: ModelConfig) -> RemBertModel:
    """An uninitialised one-process RemBertModel (tp = 1), fp32."""
    with state.offline(1):
        return RemBertModel(config).float()


def step0_encoder(config: ModelConfig, seed: int) -> RemBertModel:
    """The encoder as `RemBertForPreTraining.init_weights(seed)` initialises it: each weight is
    drawn from (seed, its full name), so the encoder alone, named with the `rembert.` prefix,
    gets the pre-training model's values."""
    model = build_encoder(config)
    with state.offline(1):
        init_weights(model, seed, config.initializer_range, prefix=ENCODER_PREFIX)
    return model.eval()


def open_checkpoint(path: str, tokenizer: str | None) -> ModelSource:
    """A step folder or save folder (its `latest`), any layout or precision."""
    step = resolve_checkpoint(path)
    meta = step.meta
    config = model_config(meta, step.path / "meta.json")
    data = meta["config"].get("data", {})
    seed = int(meta["config"].get("train", {}).get("seed", TrainConfig.seed))
    spm = tokenizer or data.get("tokenizer")
    if not spm:
        raise EvalModelError(f"--checkpoint {path}: no tokenizer recorded in its meta.json "
                             "(data.tokenizer); pass --tokenizer")
    flag = "--tokenizer" if tokenizer else f"data.tokenizer of {step.path / 'meta.json'}:"
    tok = load_tokenizer(Path(spm), flag, config.vocab_size, meta.get("tokenizer_sha256"),
                         bool(data.get("allow_larger_vocab", False)))
    return ModelSource("checkpoint", step.path, _eval_config(config), int(meta["step"]), seed,
                       tok)


def _checkpoint_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The encoder's full fp32 tensors by RemBertModel name, vocabulary padded for tp = 1:
    the fp32 master weights where the checkpoint keeps them (bf16/fp16 with ZeRO), as to-hf."""
    from megatron_rembert.checkpoint.step_folder import StepFolder

    out = {}
    with CheckpointReader(StepFolder.open(folder)) as reader:
        check_checkpoint(reader)
        for spec in param_specs(reader.model, 1):
            if spec.name.startswith(ENCODER_PREFIX):
                full = reader.master_weight(spec).float()  # fp32 masters where saved
                out[spec.name.removeprefix(ENCODER_PREFIX)] = shard(full, spec, 1, 0)
    return out


HF_WEIGHTS = "model.safetensors"


def open_hf(path: str, tokenizer: str | None) -> ModelSource:
    """A transformers RemBERT folder: config.json and model.safetensors (a pickled
    pytorch_model.bin is never read); the tokenizer is its sentencepiece.model."""
    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise EvalModelError(f"--hf {folder}: no config.json")
    try:
        hf_cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise EvalModelError(f"{cfg_file}: unreadable ({err})") from err
    if not isinstance(hf_cfg, dict) or hf_cfg.get("model_type") != "rembert":
        raise EvalModelError(f"{cfg_file}: not a RemBERT config (model_type "
                             f"{hf_cfg.get('model_type') if isinstance(hf_cfg, dict) else None!r})")
    config = config_from_hf(hf_cfg, str(cfg_file))
    weights = folder / HF_WEIGHTS
    if not weights.is_file():
        raise EvalModelError(f"--hf {folder}: no {HF_WEIGHTS} (write the folder with "
                             "rembert-convert to-hf or export-encoder; pickled "
                             "pytorch_model.bin files are not read)")
    _check_hf_tensors(weights, config, str(cfg_file))
    spm = Path(tokenizer) if tokenizer else folder / "sentencepiece.model"
    tok = load_tokenizer(spm, "--tokenizer" if tokenizer else f"--hf {folder}:",
                         config.vocab_size, None, allow_fewer=True)
    return ModelSource("hf", folder, _eval_config(config), None, TrainConfig.seed, tok)


def _check_hf_tensors(weights: Path, config: ModelConfig, source: str) -> None:
    """Every stored encoder tensor is a parameter of the model config.json describes, of its
    shape and a float dtype, and none is missing: from the header only. The MLM head's
    tensors (a to-hf folder's `cls.*`) are not read, so not checked."""
    with safe_open_checked(weights) as f:
        stored = {t.name: t for t in safetensors_entries(f, weights)}
    ours, _ = our_names(stored, str(weights))
    expected = {s.name: s.shape for s in param_specs(config, 1)
                if s.name.startswith(ENCODER_PREFIX)}
    check_tensors({name: stored[hf] for name, hf in ours.items()
                   if name.startswith(ENCODER_PREFIX)}, expected, source)


def _hf_weights(folder: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    weights = folder / HF_WEIGHTS
    with safe_open_checked(weights) as f:  # the encoder's tensors only: no MLM head read
        ours, _ = our_names(list(f.keys()), str(weights))
        hf = {name: f.get_tensor(name) for mine, name in ours.items()
              if mine.startswith(ENCODER_PREFIX)}
    full = from_hf_state_dict(hf, config)  # our names, vocabulary padded for tp = 1
    return {k.removeprefix(ENCODER_PREFIX): v.float() for k, v in full.items()
            if k.startswith(ENCODER_PREFIX)}
