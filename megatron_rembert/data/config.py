"""The `data:` section of the training config: which dataset, and how it is sampled and masked.

It lives beside the loader that reads it (`data/loader.py`); `training/config.py` loads it from
YAML with the other sections.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    path: str = ""  # dataset folder with manifest.json (data_tools/preprocess.py)
    tokenizer: str = ""  # the SentencePiece .model the dataset was made with
    seq_length: int = 512
    alpha: float = 0.5  # language sampling exponent (paper: 0.5)
    mask_prob: float = 0.15
    whole_word_mask: bool = False
    # P, masked slots per sequence (at most seq_length); 0 = derived from seq_length
    max_predictions: int = 0
    num_workers: int = 1
