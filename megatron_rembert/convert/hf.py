"""Name and shape mapping between our full (TP=1) state dict and transformers' RemBERT.

Ours -> transformers strips the vocabulary padding rows; transformers -> ours pads them with
zeros up to `padded_vocab_size(1)`. Works for `RemBertForMaskedLM` keys (`rembert.*`, `cls.*`)
and for a bare `RemBertModel` (no `rembert.` prefix, no `cls.*`).
"""

from __future__ import annotations

import re

import torch

from megatron_rembert.config import ModelConfig

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

# Tensors whose dim 0 is the vocabulary (padded on our side).
VOCAB_TENSORS = ("rembert.embeddings.word_embeddings.weight", "mlm_head.decoder.weight",
                 "mlm_head.decoder.bias")


def _compile(pattern: str) -> re.Pattern:
    regex = re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)")
    regex = regex.replace(r"\{p\}", r"(?P<p>weight|bias)")
    return re.compile(regex + "$")


_OURS_TO_HF = [(_compile(ours), hf) for ours, hf in _RULES]
_HF_TO_OURS = [(_compile(hf), ours) for ours, hf in _RULES]


def _rename(name: str, table: list[tuple[re.Pattern, str]]) -> str:
    for regex, target in table:
        match = regex.match(name)
        if match:
            return target.format(**match.groupdict())
    raise KeyError(f"no mapping for parameter {name!r}")


def to_hf_state_dict(ours: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full state dict (vocabulary padded) -> transformers `RemBertForMaskedLM` names."""
    out = {}
    for name, tensor in ours.items():
        if name in VOCAB_TENSORS:
            tensor = tensor[: config.vocab_size]
        out[_rename(name, _OURS_TO_HF)] = tensor
    if config.tie_embeddings:  # transformers' RemBERT has no tied mode: write the table twice
        out["cls.predictions.decoder.weight"] = out["rembert.embeddings.word_embeddings.weight"]
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], config: ModelConfig
                       ) -> dict[str, torch.Tensor]:
    """transformers' RemBERT state dict -> our full names, the vocabulary padded for tp = 1.

    Accepts `RemBertModel` keys without the `rembert.` prefix. Unknown keys raise KeyError.
    """
    padded = config.padded_vocab_size(1)
    out = {}
    for name, tensor in hf.items():
        if not name.startswith(("rembert.", "cls.")):
            name = "rembert." + name
        ours = _rename(name, _HF_TO_OURS)
        if ours in VOCAB_TENSORS:
            if tensor.shape[0] != config.vocab_size:
                raise ValueError(
                    f"{name}: {tensor.shape[0]} vocabulary rows, config says vocab_size="
                    f"{config.vocab_size}")
            pad = torch.zeros((padded - tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype)
            tensor = torch.cat([tensor, pad])
        out[ours] = tensor
    return out


def hf_config_dict(config: ModelConfig) -> dict:
    """Keyword arguments for `transformers.RemBertConfig` describing the same model."""
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        input_embedding_size=config.input_embedding_size,
        output_embedding_size=config.output_embedding_size,
        max_position_embeddings=config.max_position_embeddings,
        type_vocab_size=config.type_vocab_size, layer_norm_eps=config.layer_norm_eps,
        hidden_dropout_prob=config.hidden_dropout_prob,
        attention_probs_dropout_prob=config.attention_probs_dropout_prob,
        initializer_range=config.initializer_range, pad_token_id=config.pad_token_id,
        hidden_act="gelu", tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
    )


def config_from_hf(hf: dict) -> ModelConfig:
    """Our ModelConfig from a transformers RemBERT `config.json` dict."""
    if hf.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r}: only the exact 'gelu' is supported")
    fields = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size", "input_embedding_size", "output_embedding_size",
              "max_position_embeddings", "type_vocab_size", "layer_norm_eps",
              "hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range",
              "pad_token_id")
    return ModelConfig(**{k: hf[k] for k in fields if k in hf})
