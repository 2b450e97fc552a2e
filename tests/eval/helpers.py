"""Small models and evaluation sets for the eval tests, made in-process."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_rembert.checkpoint.portable import write_portable
from megatron_rembert.checkpoint.specs import param_specs
from megatron_rembert.fs import sha256_file
from megatron_rembert.model.rembert import RemBertForPreTraining
from megatron_rembert.parallel import state
from megatron_rembert.run_config.schema import Config
from tests.model.helpers import small_config

SEED = 1234


def tiny_model_config(vocab_size: int = 1000):
    """small_config's shapes (3 layers) with the test tokenizer's vocabulary."""
    return small_config().replace(vocab_size=vocab_size, max_position_embeddings=128)


def trained_like_weights(config, seed: int = SEED) -> dict[str, torch.Tensor]:
    """The step-0 weights moved by a fixed random step: a model that is not step 0."""
    with state.offline(1):
        model = RemBertForPreTraining(config)
        model.init_weights(seed)
    gen = torch.Generator().manual_seed(99)
    out = {}
    for spec in param_specs(config, 1):
        full = dict(model.named_parameters())[spec.name].detach()[: spec.shape[0]]
        out[spec.name] = full + 0.05 * torch.randn(full.shape, generator=gen)
    return out


def write_checkpoint(save_dir: Path, config, tokenizer: Path, step: int = 7,
                     weights: dict[str, torch.Tensor] | None = None,
                     dtype: torch.dtype = torch.float32) -> Path:
    """A portable checkpoint (what from-hf and reshard write) recording `tokenizer`."""
    weights = weights or trained_like_weights(config)
    full = Config(model=config, model_preset="tiny")
    full.data.tokenizer = str(tokenizer)
    full.train.seed = SEED
    meta = {"config": full.to_dict(), "tokenizer_sha256": sha256_file(tokenizer),
            "layout": {"tp": 1, "pp": 1, "dp": 1}, "consumed_samples": 0}
    specs = param_specs(config, 1)
    return write_portable(save_dir, specs, step, meta, lambda s: weights[s.name], None,
                          {s.name: dtype for s in specs})


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path
