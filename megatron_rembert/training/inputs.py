"""The start-up input checks: every cheap check before heavy work (the run plan, the data
folder, the tokenizer, the vocabulary), one ConfigError naming the setting."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rembert.config import ConfigError
from megatron_rembert.data.shards import ShardDataset
from megatron_rembert.fs import sha256_file
from megatron_rembert.launch_env import LaunchEnv
from megatron_rembert.run_config.schema import Config
from megatron_rembert.training.plan import RunPlan


def check_inputs(config: Config, world_size: int, device: torch.device, rank: int = 0,
                 plan: RunPlan | None = None, launch: LaunchEnv | None = None
                 ) -> tuple[RunPlan, str | None]:
    """Every cheap check before heavy work: the run plan (config, layout, stage split), data
    folder, tokenizer, vocabulary (the one place the model's vocabulary is compared with the
    dataset's). Returns this rank's run plan (`plan` as given, else built here once, keeping
    `launch`) and the tokenizer's sha256."""
    if plan is None:
        plan = RunPlan.build(config, world_size, rank, launch=launch)
    elif (plan.layout.world_size, plan.layout.rank) != (world_size, rank):
        raise RuntimeError(f"the run plan is of rank {plan.layout.rank} of "
                           f"{plan.layout.world_size}, this process is rank {rank} of "
                           f"{world_size}")
    if plan.layout.pp > 1:
        if device.type == "cuda" and config.parallel.backend == "gloo":
            raise ConfigError("parallel.backend=gloo with parallel.pp>1 on GPUs: gloo's "
                              "send/recv between pipeline stages take CPU tensors only (a "
                              "CUDA tensor aborts the process); use parallel.backend=nccl "
                              "(auto), one rank per GPU")
    data = config.data
    if not data.path:
        raise ConfigError("data.path is not set: point it at a folder made by "
                          "data_tools/preprocess.py (--set data.path=DIR)")
    if not Path(data.path, "manifest.json").is_file():
        raise ConfigError(f"data.path={data.path}: no manifest.json there; make the dataset "
                          "with data_tools/preprocess.py")
    sha = None
    if data.tokenizer:
        if not Path(data.tokenizer).is_file():
            raise ConfigError(f"data.tokenizer={data.tokenizer}: no such file")
        sha = sha256_file(data.tokenizer)
    # Starts hashing the shards in a background thread while the model is built (the loader
    # waits for the checks of the shards each batch reads).
    dataset = ShardDataset(data.path, "train", tokenizer_sha256=sha, seq_length=data.seq_length,
                           verify_in_background=True)
    if data.whole_word_mask:
        dataset.word_starts()  # read (and checked) now, not after the model is built
    unknown = sorted(set(data.language_start) - set(dataset.languages))
    if unknown:
        raise ConfigError(f"data.language_start names {unknown}, which data.path={data.path} "
                          f"does not have (its languages: {', '.join(dataset.languages)})")
    if data.language_start and all(data.language_start.get(lang, 0.0) > 0
                                   for lang in dataset.languages
                                   if dataset.rows_per_language[lang]):
        raise ConfigError("data.language_start: every language enters late; at least one "
                          "must be sampled from the start (leave it out, or give 0.0)")
    larger = data.allow_larger_vocab and dataset.vocab_size < config.model.vocab_size
    if dataset.vocab_size != config.model.vocab_size and not larger:
        hint = (" (data.allow_larger_vocab=true accepts a model vocabulary larger than the "
                "dataset's)" if dataset.vocab_size < config.model.vocab_size else "")
        raise ConfigError(
            f"data.path={data.path} was made with a tokenizer of {dataset.vocab_size} pieces, "
            f"model.vocab_size={config.model.vocab_size}; set model.vocab_size="
            f"{dataset.vocab_size} or use the matching dataset{hint}")
    return plan, sha
