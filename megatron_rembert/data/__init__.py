"""Data pipeline: corpus -> SentencePiece tokenizer -> packed Arrow shards -> sampled, masked
micro-batches. Numpy only (torch tensors only at the loader's edge); no torch.distributed:
ranks and sizes are passed in. See docs/data.md."""

from megatron_rembert.data.common import DataError, SpecialIds
from megatron_rembert.data.loader import (
    build_pretraining_loader,
    build_validation_loader,
    iterate_batches,
)
from megatron_rembert.data.masking import (
    MaskingConfig,
    default_max_predictions,
    mask_batch,
    mask_sequence,
)
from megatron_rembert.data.sampler import (
    MultilingualSampler,
    language_weights,
    rank_sample_indices,
)
from megatron_rembert.data.shards import SCHEMA_VERSION, ShardDataset, read_manifest

__all__ = [
    "SCHEMA_VERSION",
    "DataError",
    "MaskingConfig",
    "MultilingualSampler",
    "ShardDataset",
    "SpecialIds",
    "build_pretraining_loader",
    "build_validation_loader",
    "default_max_predictions",
    "iterate_batches",
    "language_weights",
    "mask_batch",
    "mask_sequence",
    "rank_sample_indices",
    "read_manifest",
]
