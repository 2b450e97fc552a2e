"""The model as a flat list of pipeline layers: embeddings, N Transformer layers, MLM head.

Each pipeline layer subclasses the module it wraps, keeping its parameter names, and knows its
global name prefix (`pipe_prefix`), so layout-independent initialisation and checkpoint
conversion see the same names as in the plain model.

The first stage takes the tuple `PIPE_INPUTS` (made by `pipeline_inputs`); the later stages
take `PIPE_ACTIVATIONS`: the embedding replaces the token ids and types by the hidden states
(B x S x H), the rest (B x S or B x P) travels on to the head. The last stage's forward
computes the loss and returns `MLMLoss`, as the plain model does. Two rules of DeepSpeed's
pipeline engine shape this:
- every floating-point tensor passed between stages is taken for an activation that receives a
  gradient, so the masks and labels travel as integers and the float weights as their int32
  bit pattern (exact; `view` reinterprets the bytes);
- the engine hooks the backward of the last stage's forward output to start a micro-batch's
  backward (its bf16 optimizer clears the previous bf16 gradients there). A loss computed
  after that output, in the engine's `loss_fn`, put the head's gradients in `.grad` before the
  hook fired, and the hook wiped them: the MLM head never trained. So the loss is computed
  in forward and `loss_fn` only scales it.
"""

from __future__ import annotations

import torch

from megatron_rembert.config import ModelConfig
from megatron_rembert.data import batch
from megatron_rembert.model.embeddings import RemBertEmbeddings
from megatron_rembert.model.mlm_head import MLMHead, MLMLoss, gather_positions
from megatron_rembert.model.transformer import TransformerLayer

# The order of the tuples between stages, the one place it is defined. The first stage's
# inputs are the device tensors of a micro-batch (data.batch.DEVICE_KEYS), the weights as
# int32 bits. The batch's host flag `unpadded` does not travel: reading a device tensor to
# choose the attention call would wait for the device in every layer; each stage is told the
# step's attention path instead (`set_unpadded`).
PIPE_INPUTS = batch.DEVICE_KEYS
# What every later stage receives.
PIPE_ACTIVATIONS = ("hidden", "attention_mask", "masked_positions", "masked_labels",
                    "masked_weights")


# Global name prefixes of the pipeline layers: 0 embeddings, 1..L Transformer layers, L+1 head.
EMBEDDINGS_PREFIX = "rembert.embeddings."
LAYERS_PREFIX = "rembert.layers."
HEAD_PREFIX = "mlm_head."


def pipeline_layer(name: str, num_layers: int) -> int:
    """The pipeline layer holding the parameter with global name `name`."""
    if name.startswith(EMBEDDINGS_PREFIX):
        return 0
    if name.startswith(LAYERS_PREFIX):
        return int(name.split(".")[2]) + 1
    if name.startswith(HEAD_PREFIX):
        return num_layers + 1
    raise ValueError(f"parameter {name!r} belongs to no pipeline layer")


def pipeline_inputs(micro_batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The first stage's input tuple of a micro-batch (see the module docstring)."""
    weights = micro_batch["masked_weights"].to(torch.float32).contiguous()
    return tuple(weights.view(torch.int32) if k == "masked_weights" else micro_batch[k]
                 for k in PIPE_INPUTS)


def _named(names: tuple[str, ...], values: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    return dict(zip(names, values, strict=True))


def _activations(hidden: torch.Tensor, carried: dict[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, ...]:
    """The tuple a stage hands on: `hidden`, then the other PIPE_ACTIVATIONS from `carried`."""
    return (hidden, *(carried[k] for k in PIPE_ACTIVATIONS[1:]))


class EmbeddingPipe(RemBertEmbeddings):
    pipe_prefix = EMBEDDINGS_PREFIX

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = _named(PIPE_INPUTS, inputs)
        return _activations(super().forward(x["input_ids"], x["token_type_ids"]), x)


class TransformerLayerPipe(TransformerLayer):
    def __init__(self, config: ModelConfig, index: int):
        super().__init__(config)
        self.pipe_prefix = f"{LAYERS_PREFIX}{index}."
        # The attention path of the micro-batches now running (set_unpadded): True runs
        # attention without a mask (FlashAttention on CUDA).
        self.unpadded = False

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = _named(PIPE_ACTIVATIONS, inputs)
        key_mask = None if self.unpadded else x["attention_mask"].bool()
        return _activations(super().forward(x["hidden"], key_mask), x)


def set_unpadded(layers, unpadded: bool) -> None:
    """Tell a stage's layers that the micro-batches they run next hold no padding (or may).
    Every stage and TP rank of a pipeline gets the same value from the same host batches, so
    they all take the same attention path; activation checkpointing's recomputation, within
    the same step, sees the same value."""
    for layer in layers:
        if isinstance(layer, TransformerLayerPipe):
            layer.unpadded = unpadded


class MLMHeadPipe(MLMHead):
    """Gathers the masked positions and computes the loss sums, as RemBertForPreTraining."""

    pipe_prefix = HEAD_PREFIX

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> MLMLoss:
        x = _named(PIPE_ACTIVATIONS, inputs)
        masked_weights = x["masked_weights"].contiguous().view(torch.float32)  # B x P
        return super().forward(gather_positions(x["hidden"], x["masked_positions"]),
                               x["masked_labels"].reshape(-1), masked_weights.reshape(-1))


def pipeline_layer_builders(config: ModelConfig) -> list[tuple[type, tuple]]:
    """(class, args) for every pipeline layer, in order: build only the ones a stage owns."""
    return ([(EmbeddingPipe, (config,))]
            + [(TransformerLayerPipe, (config, i)) for i in range(config.num_hidden_layers)]
            + [(MLMHeadPipe, (config,))])
