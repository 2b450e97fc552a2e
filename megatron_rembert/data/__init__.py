"""Data pipeline: corpus -> SentencePiece tokenizer -> packed Arrow shards -> sampled, masked
micro-batches. Numpy only (torch tensors only at the loader's edge); no torch.distributed:
ranks and sizes are passed in. See docs/data.md."""

import importlib

# Imported on first use (PEP 562): a preprocessing worker, which needs only the corpus reader
# and the tokenizer, then starts without the loader's imports.
_WHERE = {
    "DataError": "common", "SpecialIds": "common",
    "build_pretraining_loader": "loader", "build_validation_loader": "loader",
    "iterate_batches": "loader",
    "MaskingConfig": "masking", "default_max_predictions": "masking", "mask_batch": "masking",
    "mask_sequence": "masking",
    "MultilingualSampler": "sampler", "language_weights": "sampler",
    "rank_sample_indices": "sampler",
    "SCHEMA_VERSION": "shards", "ShardDataset": "shards", "read_manifest": "shards",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
