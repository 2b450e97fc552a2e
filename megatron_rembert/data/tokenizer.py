"""Training and loading the SentencePiece unigram tokenizer (the kind RemBERT uses).

Text is sampled per language with probability proportional to n_l^alpha (n_l = the number of
text chunks of language l; alpha = 0.5 as in Chung et al. 2020, following XLM-R), so small
languages get a larger share of the vocabulary than their share of the corpus.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from megatron_rembert.data.common import SPECIAL_PIECES, DataError, SpecialIds, sha256_file
from megatron_rembert.data.corpus import (
    DEFAULT_MAX_LINE_BYTES,
    SkipStats,
    chunk_text,
    discover_corpus,
    iter_documents,
)
from megatron_rembert.data.sampler import language_weights

WORD_START = "\u2581"  # SentencePiece's word-boundary marker
TRAIN_CHUNK_CHARS = 1000  # SentencePiece drops "sentences" over max_sentence_length bytes


def _count_chunks(files, stats, max_line_bytes) -> int:
    return sum(len(chunk_text(t, TRAIN_CHUNK_CHARS))
               for cf in files for _, t in iter_documents(cf, stats, 0, max_line_bytes))


def _write_sample(files, mult: np.ndarray, out, max_line_bytes: int) -> None:
    """Write chunk j `mult[j]` times (0 = not sampled, >1 = small language upsampled)."""
    j = 0
    for cf in files:
        for _, text in iter_documents(cf, SkipStats(), 0, max_line_bytes):
            for chunk in chunk_text(text, TRAIN_CHUNK_CHARS):
                if j < len(mult) and mult[j]:
                    out.write((chunk.replace("\n", " ") + "\n") * int(mult[j]))
                j += 1


def train_tokenizer(
    corpus_dir: str | os.PathLike,
    output_prefix: str | os.PathLike,
    vocab_size: int = 250_000,
    alpha: float = 0.5,
    character_coverage: float = 0.9995,
    num_threads: int | None = None,
    max_sentences: int = 10_000_000,
    seed: int = 0,
    languages: list[str] | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    hard_vocab_limit: bool = True,
    verbose: bool = False,
) -> dict:
    """Train `<output_prefix>.model/.vocab` and write `<output_prefix>.json` (special ids,
    sha256 of the model, vocabulary size, per-language sampling). Returns that JSON's dict.

    Two passes over the corpus: one counts chunks per language, one writes the sample, so the
    memory use is bounded by the sample, not the corpus."""
    import sentencepiece as spm

    files_by_lang, stats = discover_corpus(corpus_dir, languages)
    counts = {lang: _count_chunks(fs, stats, max_line_bytes) for lang, fs in files_by_lang.items()}
    if sum(counts.values()) == 0:
        raise DataError(f"no text in {corpus_dir}: every line was blank or skipped; "
                        f"{stats.report()}")
    langs = sorted(counts)
    probs = dict(zip(langs, language_weights([counts[x] for x in langs], alpha).tolist(),
                     strict=True))
    total = min(max_sentences, sum(counts.values()))
    rng = np.random.Generator(np.random.Philox(key=seed))
    output_prefix = Path(output_prefix)
    output_prefix.parent.mkdir(parents=True, exist_ok=True)
    sampled = {}
    with tempfile.TemporaryDirectory(dir=output_prefix.parent) as tmp:
        sample_path = Path(tmp) / "sample.txt"
        with open(sample_path, "w", encoding="utf-8") as out:
            for lang, files in files_by_lang.items():
                n = counts[lang]
                if n == 0:
                    continue
                k = max(1, round(probs[lang] * total))
                mult = np.full(n, k // n, dtype=np.int64)
                mult[rng.choice(n, k % n, replace=False)] += 1
                sampled[lang] = k
                _write_sample(files, mult, out, max_line_bytes)
        try:
            spm.SentencePieceTrainer.train(
                input=str(sample_path), model_prefix=str(output_prefix), model_type="unigram",
                vocab_size=vocab_size, character_coverage=character_coverage,
                num_threads=num_threads or os.cpu_count() or 1, input_sentence_size=0,
                max_sentence_length=8192, hard_vocab_limit=hard_vocab_limit,
                pad_id=0, unk_id=1, bos_id=-1, eos_id=-1,
                pad_piece=SPECIAL_PIECES["pad"], unk_piece=SPECIAL_PIECES["unk"],
                # control symbols: text that happens to contain "[MASK]" is not turned into it
                control_symbols=[SPECIAL_PIECES[k] for k in ("cls", "sep", "mask")],
                minloglevel=0 if verbose else 2,
            )
        except RuntimeError as e:
            raise DataError(f"SentencePiece training failed: {e}. Check --vocab-size (too large "
                            "for this corpus: lower it or pass --no-hard-vocab-limit; smaller "
                            "than the alphabet: raise it or lower --character-coverage).") from e
    model_path = output_prefix.with_name(output_prefix.name + ".model")
    sp = load_sentencepiece(model_path)
    info = {
        "model_file": model_path.name,
        "sha256": sha256_file(model_path),
        "vocab_size": sp.get_piece_size(),
        "special_ids": check_special_ids(sp, model_path).to_dict(),
        "special_tokens": SPECIAL_PIECES,
        "alpha": alpha,
        "character_coverage": character_coverage,
        "languages": {lang: {"chunks": counts[lang], "sampled": sampled.get(lang, 0),
                             "prob": probs[lang]} for lang in sorted(counts)},
        "skipped": stats.to_dict(),
    }
    with open(output_prefix.with_name(output_prefix.name + ".json"), "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
    return info


def load_sentencepiece(model_path: str | os.PathLike):
    import sentencepiece as spm

    if not Path(model_path).is_file():
        raise DataError(f"tokenizer model {model_path} not found; train one with "
                        "data_tools/train_tokenizer.py or fix --tokenizer.")
    sp = spm.SentencePieceProcessor()
    try:
        sp.load(str(model_path))
    except (OSError, RuntimeError) as e:
        raise DataError(f"{model_path} is not a SentencePiece model: {e}") from e
    return sp


def check_special_ids(sp, model_path: str | os.PathLike = "tokenizer") -> SpecialIds:
    """The model's special ids must be the fixed ones (PAD=0, UNK=1, CLS=2, SEP=3, MASK=4)."""
    want = SpecialIds()
    for name, piece in SPECIAL_PIECES.items():
        got = sp.piece_to_id(piece)
        if got != getattr(want, name) or sp.id_to_piece(got) != piece:
            raise DataError(f"{model_path}: special token {piece} has id {got}, expected "
                            f"{getattr(want, name)}; train the tokenizer with "
                            "data_tools/train_tokenizer.py, which fixes these ids.")
    return want


def word_start_table(sp) -> np.ndarray:
    """[V] bool: piece i begins a word (starts with U+2581). Used by whole-word masking."""
    return np.array([sp.id_to_piece(i).startswith(WORD_START) for i in range(sp.get_piece_size())],
                    dtype=bool)
