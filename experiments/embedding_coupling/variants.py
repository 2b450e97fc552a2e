"""The paper's embedding variants (Chung et al., 2020, Sections 3-4), scaled.

Every variant shares one hidden size H, one tokenizer and one token budget; only the embeddings
(and, for `reinvested`, the depth) differ:

| variant            | E_in  | E_out | tied | layers | the paper's point                          |
|--------------------|-------|-------|------|--------|--------------------------------------------|
| coupled            | H     | H     | yes  | L      | the mBERT baseline                         |
| decoupled          | H     | H     | no   | L      | untying alone helps                        |
| small-in-large-out | H/4   | 2H    | no   | L      | E_in can shrink, a large E_out helps       |
| small-in-small-out | H/4   | H/4   | no   | L      | a small E_out hurts                        |
| reinvested         | H/4   | 2H    | no   | L + k  | the saved input parameters buy depth       |

`reinvested` takes as many extra layers as keep its fine-tuning parameters (encoder without the
output embedding) at or under the coupled model's, as RemBERT does at full scale.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_rembert.config import ModelConfig
from megatron_rembert.model.sizes import parameter_counts


@dataclass(frozen=True)
class Scale:
    """Model and budget of one scale of the experiment."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    seq_length: int
    global_batch_size: int
    micro_batch_size: int
    steps: int
    lr: float
    warmup_steps: int
    precision: str
    ds_config: str


SCALES = {
    # One run is sized to finish in well under 45 minutes on 2 CPU cores (docs/experiments.md
    # gives the measured time).
    "cpu": Scale(vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 intermediate_size=1024, seq_length=128, global_batch_size=32,
                 micro_batch_size=32, steps=2000, lr=1e-3, warmup_steps=200,
                 precision="fp32", ds_config="ds_configs/cpu_fp32.json"),
    # Half as wide, 5 epochs of the same text in the same time (20,000 tokens/s on 2 cores):
    # small models over many epochs are where cross-lingual structure is reported to emerge
    # from little data (Dufter and Schuetze, 2020). The search's second setup.
    "cpu-small": Scale(vocab_size=8000, hidden_size=128, num_hidden_layers=4,
                       num_attention_heads=2, intermediate_size=512, seq_length=128,
                       global_batch_size=32, micro_batch_size=32, steps=10000, lr=1e-3,
                       warmup_steps=500, precision="fp32", ds_config="ds_configs/cpu_fp32.json"),
    # The same experiment on one GPU: mBERT-base width, the paper's recipe shape.
    "gpu": Scale(vocab_size=32000, hidden_size=768, num_hidden_layers=12,
                 num_attention_heads=12, intermediate_size=3072, seq_length=256,
                 global_batch_size=256, micro_batch_size=64, steps=20000, lr=4e-4,
                 warmup_steps=2000, precision="bf16", ds_config="ds_configs/zero1_bf16.json"),
}

VARIANTS = ("coupled", "decoupled", "small-in-large-out", "small-in-small-out", "reinvested")


def base_model(scale: Scale) -> ModelConfig:
    return ModelConfig(vocab_size=scale.vocab_size, hidden_size=scale.hidden_size,
                       num_hidden_layers=scale.num_hidden_layers,
                       num_attention_heads=scale.num_attention_heads,
                       intermediate_size=scale.intermediate_size,
                       input_embedding_size=scale.hidden_size,
                       output_embedding_size=scale.hidden_size,
                       max_position_embeddings=max(512, scale.seq_length))


def variant_model(name: str, scale: Scale) -> ModelConfig:
    """The ModelConfig of one variant at one scale."""
    h = scale.hidden_size
    base = base_model(scale)
    if name == "coupled":
        return replace(base, tie_embeddings=True)
    if name == "decoupled":
        return base
    if name == "small-in-large-out":
        return replace(base, input_embedding_size=h // 4, output_embedding_size=2 * h)
    if name == "small-in-small-out":
        return replace(base, input_embedding_size=h // 4, output_embedding_size=h // 4)
    if name == "reinvested":
        budget = parameter_counts(variant_model("coupled", scale)).finetuning
        model = variant_model("small-in-large-out", scale)
        while True:
            deeper = replace(model, num_hidden_layers=model.num_hidden_layers + 1)
            if parameter_counts(deeper).finetuning > budget:
                return model
            model = deeper
    raise ValueError(f"unknown variant {name!r}; one of {', '.join(VARIANTS)}")
