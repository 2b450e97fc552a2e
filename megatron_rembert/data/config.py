"""The `data:` section of the training config: which dataset, and how it is sampled and masked.

It lives beside the loader that reads it (`data/loader.py`); `run_config.py` loads it from
YAML with the other sections. The schedules (`phase_*`, `mask_schedule`, `language_start`) are
read by `data/schedule.py`; empty lists keep `alpha` and `mask_prob` for the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DataConfig:
    path: str = ""  # dataset folder with manifest.json (data_tools/preprocess.py)
    tokenizer: str = ""  # the SentencePiece .model the dataset was made with
    seq_length: int = 512
    alpha: float = 0.5  # language sampling exponent (paper: 0.5); 1/temperature
    mask_prob: float = 0.15
    whole_word_mask: bool = False
    # accept a dataset whose tokenizer has fewer pieces than model.vocab_size (the extra rows
    # are never an input or a target), e.g. the full-size model on a small test dataset
    allow_larger_vocab: bool = False
    # P, masked slots per sequence (at most seq_length); 0 = derived from seq_length and the
    # largest mask rate of the schedule
    max_predictions: int = 0
    num_workers: int = 1
    # Phase i starts at phase_starts[i] x train.steps (fractions, increasing, the first 0.0);
    # [] = one phase
    phase_starts: list[float] = field(default_factory=list)
    # alpha of each phase, one per phase_starts entry ([] = data.alpha throughout)
    phase_alpha: list[float] = field(default_factory=list)
    # mask rate of each phase, one per phase_starts entry ([] = data.mask_prob throughout)
    phase_mask_prob: list[float] = field(default_factory=list)
    # step: each phase's rate for the whole phase; linear: from one phase's rate to the next's
    mask_schedule: str = "step"
    # language -> fraction of train.steps from which it is sampled (default 0.0: from the start)
    language_start: dict[str, float] = field(default_factory=dict)
