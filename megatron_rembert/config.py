"""Model configuration: the fields of `transformers.RemBertConfig` plus what the paper ablates.

Presets are the paper's models (Chung et al., 2020, "Rethinking embedding coupling in
pre-trained language models"): the released RemBERT and the mBERT-sized embedding ablations
of its Section 4.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass

from megatron_rembert.errors import UserError


class ConfigError(UserError):
    """A configuration value is invalid; the message names the field and the fix."""


@dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: finite, from `low` to `high` (None: unbounded),
    each end included unless marked open. Shown in `train.py --help` and in the error."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        return (math.isfinite(value)
                and (self.low is None or value > self.low or (value == self.low
                                                              and not self.low_open))
                and (self.high is None or value < self.high or (value == self.high
                                                                and not self.high_open)))

    def __str__(self) -> str:
        low, high = (f"{x:g}" if isinstance(x, float) else str(x) for x in (self.low, self.high))
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {low}"
        return f"{'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"

    def check(self, key: str, value: float) -> None:
        if value not in self:
            finite = "a finite number " if isinstance(value, float) else ""
            bounds = str(self) if self.high is None else f"in {self}"
            raise ConfigError(f"{key}={value}: must be {finite}{bounds}")


def setting(default=dataclasses.MISSING, *, help: str,
            default_factory=dataclasses.MISSING):
    """A config field with its `--help` text (dataclasses.field's metadata["help"]): what
    `run_config.help.config_help` prints for it, and all it prints besides its default and
    allowed values."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"help": help})


AT_LEAST_1 = Range(1)
AT_LEAST_0 = Range(0)
POSITIVE = Range(0, low_open=True)
PROBABILITY = Range(0.0, 1.0, high_open=True)  # [0, 1): dropout, Adam's betas


@dataclass
class ModelConfig:
    vocab_size: int = setting(
        250_300,
        help=(
            "pieces in the vocabulary (the tokenizer's; padded to 128 x tp in the model)"))
    hidden_size: int = setting(1152, help="H, the Transformer width")
    num_hidden_layers: int = setting(32, help="Transformer layers")
    num_attention_heads: int = setting(18, help="attention heads (must divide hidden_size)")
    intermediate_size: int = setting(4608, help="width of each layer's feed-forward block")
    input_embedding_size: int = setting(
        256,
        help=(
            "E_in: width of the input embedding table; projected to hidden_size before layer 0."))
    output_embedding_size: int = setting(
        1664,
        help=(
            "E_out: width of the output embedding (MLM decoder), used only in pre-training."))
    max_position_embeddings: int = setting(
        512,
        help=(
            "longest sequence the position table holds (>= data.seq_length)"))
    type_vocab_size: int = setting(2, help="token-type (segment) embeddings")
    layer_norm_eps: float = setting(1e-12, help="LayerNorm epsilon")
    hidden_dropout_prob: float = setting(
        0.0,
        help=(
            "dropout after the embeddings, attention output and feed-forward block"))
    attention_probs_dropout_prob: float = setting(0.0,
                                                  help="dropout on the attention probabilities")
    initializer_range: float = setting(
        0.02,
        help=(
            "standard deviation of the normal weight initialisation"))
    pad_token_id: int = setting(0, help="the padding piece (below vocab_size)")
    tie_embeddings: bool = setting(
        False,
        help=(
            "Coupled baselines: the MLM decoder reuses the input embedding table (needs E_in == "
            "E_out)."))
    attention_backend: str = setting(
        "sdpa",
        help=(
            '"sdpa" (torch.nn.functional.scaled_dot_product_attention) or "fused_softmax" '
            "(Triton)."))
    loss_backend: str = setting(
        "fused",
        help=(
            'MLM loss: "fused" (chunked linear + cross-entropy, holds logits only within '
            'loss_keep_logits_gib) or "reference" (logits for all masked tokens, then a '
            "vocab-parallel cross-entropy)."))
    loss_chunk_rows: int = setting(
        0,
        help=(
            "Fused loss: most rows per chunk of the output projection (0 = the device's default: "
            "logits tiles of up to 2^29 elements on CUDA, 2,144 rows at a 250k vocabulary shard; "
            "2^25 on CPU, 128 rows). Rows are split into equal chunks; see docs/kernels.md."))
    loss_keep_logits_gib: float = setting(
        1.0,
        help=(
            "Fused loss: GiB of forward logits kept for backward, which then skips recomputing "
            "them (3 GEMMs of the vocabulary projection instead of 4); chunks beyond it are "
            "recomputed. rembert's 16 x 77 masked rows take 0.57 GiB in bf16 at tp 1. 0 = "
            "recompute all."))
    compile: bool | str = setting(
        "auto",
        help=(
            "torch.compile each Transformer layer (one graph for all layers; the embeddings and "
            "the head stay eager): true, false, or auto (compiled on CUDA, eager on CPU)."))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Vocabulary rounded up to a multiple of 128 x tp (even shards, aligned GEMMs).

        Padded rows never take probability mass: their logits are masked to -inf.
        """
        multiple = 128 * tp
        return -(-self.vocab_size // multiple) * multiple

    def validate(self) -> None:
        """Raise ConfigError naming the field if this model is not a valid one, at any layout
        (`check_buildable` adds what a tp x pp layout needs)."""
        for name, allowed in MODEL_RANGES.items():
            allowed.check(f"model.{name}", getattr(self, name))
        for name, allowed in MODEL_CHOICES.items():
            check_choice(f"model.{name}", getattr(self, name), allowed)
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}; pick a head count "
                "that divides the hidden size")
        if self.tie_embeddings and self.input_embedding_size != self.output_embedding_size:
            raise ConfigError(
                "model.tie_embeddings=true needs model.input_embedding_size == "
                f"model.output_embedding_size, got {self.input_embedding_size} and "
                f"{self.output_embedding_size}")
        if not self.pad_token_id < self.vocab_size:
            raise ConfigError(f"model.pad_token_id={self.pad_token_id} is outside the vocabulary "
                              f"(model.vocab_size={self.vocab_size})")

    def compiles_on(self, device_type: str) -> bool:
        """Whether the Transformer layers run through torch.compile on a device of this type
        ("cuda", "cpu"): model.compile, with auto resolved."""
        return self.compile is True or (self.compile == "auto" and device_type == "cuda")

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


# Fields that choose how the model is computed, not what it is: a checkpoint resumes, averages
# and converts across them.
EXECUTION_FIELDS = ("attention_backend", "loss_backend", "loss_chunk_rows", "loss_keep_logits_gib",
                    "compile")

# Every numeric field of ModelConfig and the values it may take.
MODEL_RANGES: dict[str, Range] = {
    **dict.fromkeys(("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "input_embedding_size", "output_embedding_size",
                     "max_position_embeddings", "type_vocab_size"), AT_LEAST_1),
    "layer_norm_eps": Range(0.0, 1.0, low_open=True, high_open=True),
    "hidden_dropout_prob": PROBABILITY,
    "attention_probs_dropout_prob": PROBABILITY,
    "initializer_range": POSITIVE,
    "pad_token_id": AT_LEAST_0,  # and < vocab_size
    "loss_chunk_rows": AT_LEAST_0,  # 0: the device's default
    "loss_keep_logits_gib": AT_LEAST_0,  # 0: recompute the logits in backward
}

# Every ModelConfig field that takes one of a few values, and those values.
MODEL_CHOICES: dict[str, tuple] = {
    "attention_backend": ("sdpa", "fused_softmax"),
    "loss_backend": ("fused", "reference"),
    "compile": (True, False, "auto"),
}


def choice_text(value) -> str:
    """A choice as the YAML spells it: true/false for booleans."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_choice(key: str, value, allowed: tuple) -> None:
    """Raise ConfigError naming `key` unless `value` is one of `allowed` (type included: the
    integer 1 is not true)."""
    if not any(type(value) is type(a) and value == a for a in allowed):
        words = [choice_text(a) for a in allowed]
        raise ConfigError(f"{key}={value!r}: expected {', '.join(words[:-1])} or {words[-1]}")


def check_buildable(model: ModelConfig, tp: int, pp: int) -> None:
    """Whether `model` can be built at parallel.tp x parallel.pp: a valid model, whole heads
    and FFN columns on each tensor-parallel rank, at least one Transformer layer per pipeline
    stage, tied embeddings on one stage. The trainer and the converters (reshard, from-hf)
    ask this one question; raises ConfigError naming the key."""
    model.validate()
    for key, size in (("parallel.tp", tp), ("parallel.pp", pp)):
        if size < 1:
            raise ConfigError(f"{key}={size}: must be >= 1")
    if model.num_attention_heads % tp:
        raise ConfigError(
            f"model.num_attention_heads={model.num_attention_heads} is not divisible by "
            f"parallel.tp={tp}; each tensor-parallel rank must hold whole heads")
    if model.intermediate_size % tp:
        raise ConfigError(
            f"model.intermediate_size={model.intermediate_size} is not divisible by "
            f"parallel.tp={tp}")
    if model.num_hidden_layers < pp:
        raise ConfigError(f"model.num_hidden_layers={model.num_hidden_layers} is fewer than "
                          f"parallel.pp={pp} pipeline stages")
    if pp > 1 and model.tie_embeddings:
        raise ConfigError("model.tie_embeddings=true needs parallel.pp=1: the tied table would "
                          "span the first and last pipeline stages")

# The paper's ablation baseline (Section 4): mBERT-sized, 12 layers, H 768, 12 heads, a 120k
# vocabulary (its exact size is not given), no dropout.
_MBERT_SIZED = dict(vocab_size=120_000, hidden_size=768, num_hidden_layers=12,
                    num_attention_heads=12, intermediate_size=3072)

PRESETS: dict[str, ModelConfig] = {
    # The released RemBERT (transformers' RemBertConfig defaults). E_out = 1664, not the
    # 1536 of the paper's text: only 1664 reproduces the 995M pre-training parameters.
    "rembert": ModelConfig(),
    "coupled": ModelConfig(**_MBERT_SIZED, input_embedding_size=768,
                           output_embedding_size=768, tie_embeddings=True),
    "decoupled": ModelConfig(**_MBERT_SIZED, input_embedding_size=768,
                             output_embedding_size=768),
    "ein128-eout768": ModelConfig(**_MBERT_SIZED, input_embedding_size=128,
                                  output_embedding_size=768),
    "ein768-eout128": ModelConfig(**_MBERT_SIZED, input_embedding_size=768,
                                  output_embedding_size=128),
    "ein128-eout128": ModelConfig(**_MBERT_SIZED, input_embedding_size=128,
                                  output_embedding_size=128),
    "ein128-eout3072": ModelConfig(**_MBERT_SIZED, input_embedding_size=128,
                                   output_embedding_size=3072),
    # ALBERT-style factorised coupled embedding: one 128-wide table used for input and output.
    "albert-coupled128": ModelConfig(**_MBERT_SIZED, input_embedding_size=128,
                                     output_embedding_size=128, tie_embeddings=True),
    # For tests and the CPU demo: 6 heads and FFN 192 divide by tp = 2 and 3.
    "tiny": ModelConfig(vocab_size=1000, hidden_size=48, num_hidden_layers=2,
                        num_attention_heads=6, intermediate_size=192, input_embedding_size=16,
                        output_embedding_size=24, max_position_embeddings=128),
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        close = difflib.get_close_matches(str(name), list(PRESETS), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"unknown model preset {name!r}; {hint}choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name])
