"""The mapping between our model and transformers' RemBERT: names, vocabulary rows, config.

One mapping serves both directions and both uses: the streamed converters (hf_io.py, the CLI)
and the in-memory `to_hf_state_dict` / `from_hf_state_dict` (tests and benches), which are
thin wrappers over the same name functions. Ours -> transformers strips the vocabulary
padding rows; transformers -> ours pads them with zeros up to `padded_vocab_size(1)`. Works
for `RemBertForMaskedLM` keys (`rembert.*`, `cls.*`) and a bare `RemBertModel` (no
`rembert.` prefix, no `cls.*`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from megatron_rembert.config import ConfigError, ModelConfig
from megatron_rembert.convert.files import ConvertError

# The ModelConfig fields that transformers' RemBertConfig shares, by the same names.
HF_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size", "input_embedding_size", "output_embedding_size",
             "max_position_embeddings", "type_vocab_size", "layer_norm_eps",
             "hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range",
             "pad_token_id")

# (our name pattern, transformers' name pattern); {i} is a layer index, {p} weight or bias.
_OURS_LAYER, _HF_LAYER = "rembert.layers.{i}.", "rembert.encoder.layer.{i}."
_RULES: list[tuple[str, str]] = [
    ("rembert.embeddings.word_embeddings.weight", "rembert.embeddings.word_embeddings.weight"),
    ("rembert.embeddings.position_embeddings.weight",
     "rembert.embeddings.position_embeddings.weight"),
    ("rembert.embeddings.token_type_embeddings.weight",
     "rembert.embeddings.token_type_embeddings.weight"),
    ("rembert.embeddings.layer_norm.{p}", "rembert.embeddings.LayerNorm.{p}"),
    ("rembert.embeddings.projection.{p}", "rembert.encoder.embedding_hidden_mapping_in.{p}"),
    (_OURS_LAYER + "attention.query.{p}", _HF_LAYER + "attention.self.query.{p}"),
    (_OURS_LAYER + "attention.key.{p}", _HF_LAYER + "attention.self.key.{p}"),
    (_OURS_LAYER + "attention.value.{p}", _HF_LAYER + "attention.self.value.{p}"),
    (_OURS_LAYER + "attention.dense.{p}", _HF_LAYER + "attention.output.dense.{p}"),
    (_OURS_LAYER + "attention_norm.{p}", _HF_LAYER + "attention.output.LayerNorm.{p}"),
    (_OURS_LAYER + "ffn.intermediate.{p}", _HF_LAYER + "intermediate.dense.{p}"),
    (_OURS_LAYER + "ffn.output.{p}", _HF_LAYER + "output.dense.{p}"),
    (_OURS_LAYER + "ffn_norm.{p}", _HF_LAYER + "output.LayerNorm.{p}"),
    ("rembert.pooler.dense.{p}", "rembert.pooler.dense.{p}"),
    ("mlm_head.dense.{p}", "cls.predictions.dense.{p}"),
    ("mlm_head.layer_norm.{p}", "cls.predictions.LayerNorm.{p}"),
    ("mlm_head.decoder.{p}", "cls.predictions.decoder.{p}"),
]
WORD_EMBEDDINGS, HF_DECODER = "rembert.embeddings.word_embeddings.weight", \
    "cls.predictions.decoder.weight"
# Tensors whose dim 0 is the vocabulary (padded on our side).
VOCAB_TENSORS = (WORD_EMBEDDINGS, "mlm_head.decoder.weight", "mlm_head.decoder.bias")


def _compile(pattern: str) -> re.Pattern:
    regex = re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)")
    regex = regex.replace(r"\{p\}", r"(?P<p>weight|bias)")
    return re.compile(regex + "$")


_OURS_TO_HF = [(_compile(ours), hf) for ours, hf in _RULES]
_HF_TO_OURS = [(_compile(hf), ours) for ours, hf in _RULES]


def _rename(name: str, table: list[tuple[re.Pattern, str]], where: str) -> str:
    for regex, target in table:
        match = regex.match(name)
        if match:
            return target.format(**match.groupdict())
    raise ConvertError(f"{where}: no mapping for tensor {name!r}")


def hf_names(ours: Iterable[str], config: ModelConfig, encoder_only: bool = False
             ) -> list[tuple[str, str]]:
    """(transformers name, our name) for every tensor to write: the MLM head dropped when
    `encoder_only` (and names without the `rembert.` prefix, as RemBertModel has them); a tied
    word embedding written twice, as transformers' RemBERT has no tied mode."""
    out = []
    for name in ours:
        if encoder_only and name.startswith("mlm_head."):
            continue
        hf = _rename(name, _OURS_TO_HF, "our model")
        out.append((hf.removeprefix("rembert.") if encoder_only else hf, name))
    if config.tie_embeddings and not encoder_only:
        out.append((HF_DECODER, WORD_EMBEDDINGS))
    return out


def our_names(hf: Iterable[str], where: str) -> tuple[dict[str, str], list[str]]:
    """({our name: transformers name}, dropped pooler names) of a transformers checkpoint."""
    ours, dropped = {}, []
    for name in hf:
        full = name if name.startswith(("rembert.", "cls.")) else "rembert." + name
        if full.startswith("rembert.pooler."):
            dropped.append(name)  # the pre-training model has no pooler
            continue
        ours[_rename(full, _HF_TO_OURS, where)] = name
    return ours, dropped


def check_vocab_rows(name: str, tensor: torch.Tensor, config: ModelConfig, where: str) -> None:
    if tensor.shape[0] != config.vocab_size:
        raise ConvertError(f"{where}: {name} has {tensor.shape[0]} vocabulary rows, the config "
                           f"says vocab_size={config.vocab_size}")


def to_hf_state_dict(ours: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full state dict (vocabulary padded) -> transformers `RemBertForMaskedLM` names."""
    return {hf: ours[name][: config.vocab_size] if name in VOCAB_TENSORS else ours[name]
            for hf, name in hf_names(ours, config)}


def from_hf_state_dict(hf: dict[str, torch.Tensor], config: ModelConfig
                       ) -> dict[str, torch.Tensor]:
    """transformers' RemBERT state dict -> our full names, the vocabulary padded for tp = 1.
    Unknown tensors raise ConvertError; the pooler is dropped."""
    padded = config.padded_vocab_size(1)
    out = {}
    for ours, name in our_names(hf, "state dict")[0].items():
        tensor = hf[name]
        if ours in VOCAB_TENSORS:
            check_vocab_rows(name, tensor, config, "state dict")
            pad = torch.zeros((padded - tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype)
            tensor = torch.cat([tensor, pad])
        out[ours] = tensor
    return out


def hf_config_dict(config: ModelConfig) -> dict:
    """Keyword arguments for `transformers.RemBertConfig` describing the same model."""
    return {**{k: getattr(config, k) for k in HF_FIELDS}, "hidden_act": "gelu",
            "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None}


def config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """Our ModelConfig from a transformers RemBERT `config.json` dict."""
    if hf.get("hidden_act", "gelu") != "gelu":
        raise ConvertError(f"{where}: hidden_act={hf['hidden_act']!r}; only the exact 'gelu' "
                           "is supported")
    values = {}
    for key in HF_FIELDS:
        if key not in hf:
            continue
        value, kind = hf[key], type(ModelConfig.__dataclass_fields__[key].default)
        if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
            raise ConvertError(f"{where}: {key}={value!r}, expected {kind.__name__}")
        values[key] = value
    model = ModelConfig(**values)
    try:
        model.validate()
    except ConfigError as err:
        raise ConvertError(f"{where}: {err}") from err
    return model
