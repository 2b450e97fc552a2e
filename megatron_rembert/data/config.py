"""The `data:` section of the training config: which dataset, and how it is sampled and masked.

It lives beside the loader that reads it (`data/loader.py`); `run_config/load.py` loads it from
YAML with the other sections. The schedules (`phase_*`, `mask_schedule`, `language_start`) are
read by `data/schedule.py`; empty lists keep `alpha` and `mask_prob` for the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rembert.config import setting


@dataclass
class DataConfig:
    path: str = setting("", help="dataset folder with manifest.json (data_tools/preprocess.py)")
    tokenizer: str = setting("", help="the SentencePiece .model the dataset was made with")
    seq_length: int = setting(512, help="tokens per training sequence, [CLS] and [SEP] included")
    alpha: float = setting(0.5, help="language sampling exponent (paper: 0.5); 1/temperature")
    mask_prob: float = setting(
        0.15,
        help=(
            "share of tokens masked for MLM (data.phase_mask_prob schedules it)"))
    whole_word_mask: bool = setting(
        False,
        help=(
            "mask whole words (every piece of a word together), not single pieces"))
    allow_larger_vocab: bool = setting(
        False,
        help=(
            "accept a dataset whose tokenizer has fewer pieces than model.vocab_size (the extra "
            "rows are never an input or a target), e.g. the full-size model on a small test "
            "dataset"))
    max_predictions: int = setting(
        0,
        help=(
            "P, masked slots per sequence (at most seq_length); 0 = derived from seq_length and "
            "the largest mask rate of the schedule"))
    num_workers: int = setting(
        1,
        help=(
            "data-loader worker processes per rank (0 = batches made in the trainer)"))
    phase_starts: list[float] = setting(
        default_factory=list,
        help=(
            "Phase i starts at phase_starts[i] x train.steps (fractions, increasing, the first "
            "0.0); [] = one phase"))
    phase_alpha: list[float] = setting(
        default_factory=list,
        help=(
            "alpha of each phase, one per phase_starts entry ([] = data.alpha throughout)"))
    phase_mask_prob: list[float] = setting(
        default_factory=list,
        help=(
            "mask rate of each phase, one per phase_starts entry ([] = data.mask_prob throughout)"))
    mask_schedule: str = setting(
        "step",
        help=(
            "step: each phase's rate for the whole phase; linear: from one phase's rate to the "
            "next's"))
    language_start: dict[str, float] = setting(
        default_factory=dict,
        help=(
            "language -> fraction of train.steps from which it is sampled (default 0.0: from the "
            "start)"))
