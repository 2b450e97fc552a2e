"""The settings of one evaluation, with their defaults (the command line's too); no torch
import, so `rembert-eval --help` starts fast."""

from __future__ import annotations

from dataclasses import dataclass

BASELINES = ("step0", "bag", "chance")


@dataclass
class Settings:
    layers: list[int]  # retrieval layers computed (0 = embeddings)
    layer: int  # the layer of the per-language table
    max_length: int = 128
    max_pairs: int = 1000
    seeds: int = 3
    epochs: int = 3
    lr: float = 1e-3
    batch_size: int = 32
    encode_batch_size: int = 64
    train_lang: str = "en"
    baselines: tuple[str, ...] = BASELINES
    bag_weighting: str = "counts"
    center: bool = False  # subtract each language's mean embedding before the cosine
    device: str = "cpu"
    init_seed: int | None = None  # the step-0 model's seed; None: the source's train.seed
