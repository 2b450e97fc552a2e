"""Training and loading the SentencePiece unigram tokenizer (the kind RemBERT uses).

Text is sampled per language with probability proportional to n_l^alpha (n_l = the number of
text chunks of language l; alpha = 0.5 as in Chung et al. 2020, following XLM-R), so small
languages get a larger share of the vocabulary than their share of the corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from megatron_rembert.data.common import SPECIAL_PIECES, DataError, SpecialIds
from megatron_rembert.data.sampler import language_weights
from megatron_rembert.fs import atomic_write, atomic_write_json, sha256_file
from megatron_rembert.prep.corpus import (
    DEFAULT_MAX_LINE_BYTES,
    SkipStats,
    chunk_text,
    discover_corpus,
    iter_documents,
)

WORD_START = "\u2581"  # SentencePiece's word-boundary marker
TRAIN_CHUNK_CHARS = 1000  # SentencePiece drops "sentences" over max_sentence_length bytes


def _count_chunks(files, stats, max_line_bytes) -> int:
    return sum(len(chunk_text(t, TRAIN_CHUNK_CHARS))
               for cf in files for _, t in iter_documents(cf, stats, 0, max_line_bytes))


def sample_sizes(counts: dict[str, int], probs: dict[str, float], total: int) -> dict[str, int]:
    """Chunks each language gets in the sample: `total` split by `probs` (largest remainders,
    so the sizes add up to `total` exactly), at least one for a language with text (taken from
    the largest share)."""
    langs = [lang for lang in sorted(counts) if counts[lang]]
    exact = {lang: probs[lang] * total for lang in langs}
    sizes = {lang: int(exact[lang]) for lang in langs}
    by_remainder = sorted(langs, key=lambda lang: (sizes[lang] - exact[lang], lang))
    for lang in by_remainder[:total - sum(sizes.values())]:
        sizes[lang] += 1
    for lang in langs:
        if sizes[lang] == 0:
            sizes[max(sizes, key=sizes.get)] -= 1
            sizes[lang] = 1
    return sizes


def _write_sample(files, mult: np.ndarray, out, digest, max_line_bytes: int) -> None:
    """Write chunk j `mult[j]` times (0 = not sampled, >1 = small language upsampled), and
    feed the written bytes to `digest`."""
    j = 0
    for cf in files:
        for _, text in iter_documents(cf, SkipStats(), 0, max_line_bytes):
            for chunk in chunk_text(text, TRAIN_CHUNK_CHARS):
                if j < len(mult) and mult[j]:
                    data = ((chunk.replace("\n", " ") + "\n") * int(mult[j])).encode("utf-8")
                    out.write(data)
                    digest.update(data)
                j += 1


def _reproducible_model(model_bytes: bytes, model_name: str) -> bytes:
    """The .model with the paths SentencePiece records replaced by fixed names.

    SentencePiece stores `input` (our sample, in a private temp folder with a random name) and
    `model_prefix` in the model's trainer_spec, so every training gave another file and
    another sha256, which is the tokenizer's identity for datasets and checkpoints. We rewrite
    those two fields rather than train from a fixed path: a fixed path would be shared by two
    trainings running at once, and the output folder's own path would still end up inside."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_bytes)
    del proto.trainer_spec.input[:]
    proto.trainer_spec.input.append("sample.txt")
    proto.trainer_spec.model_prefix = model_name
    return proto.SerializeToString()


def _existing_info(output_prefix: Path, sample_sha256: str, trainer: dict) -> dict | None:
    """The info of a tokenizer already at `output_prefix` if it was trained from the same
    sample with the same settings and is intact, else None."""
    json_path = output_prefix.with_name(output_prefix.name + ".json")
    model_path = output_prefix.with_name(output_prefix.name + ".model")
    if not (json_path.is_file() and model_path.is_file()):
        return None
    try:
        info = json.loads(json_path.read_text())
    except json.JSONDecodeError:
        return None
    same = (info.get("sample_sha256") == sample_sha256 and info.get("trainer") == trainer
            and info.get("sha256") == sha256_file(model_path))
    return info if same else None


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
    existing: str = "overwrite",
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Train `<output_prefix>.model/.vocab` and write `<output_prefix>.json` (special ids,
    sha256 of the model, vocabulary size, per-language sampling, the sample's sha256 and the
    trainer settings). Returns that JSON's dict.

    The same corpus and settings (`num_threads` included: SentencePiece's scores depend on it)
    give a byte-identical .model. `existing`: what to do with a tokenizer already at
    `output_prefix`: "overwrite" it, or "reuse" it when it was trained from the same sample
    and settings (returned with `"reused": True`, nothing written) and raise DataError when it
    was not. `progress` gets one line per stage (the SentencePiece stage is the long one).

    Two passes over the corpus: one counts chunks per language, one writes the sample, so the
    memory use is bounded by the sample, not the corpus."""
    import sentencepiece as spm

    if existing not in ("overwrite", "reuse"):
        raise ValueError(f"existing={existing!r}; expected 'overwrite' or 'reuse'")
    say = progress or (lambda line: None)
    t0 = time.perf_counter()
    files_by_lang, stats = discover_corpus(corpus_dir, languages)
    counts = {lang: _count_chunks(fs, stats, max_line_bytes) for lang, fs in files_by_lang.items()}
    if sum(counts.values()) == 0:
        raise DataError(f"no text in {corpus_dir}: every line was blank or skipped; "
                        f"{stats.report()}")
    say(f"read {sum(counts.values()):,} text passages in {len(counts)} languages (a passage: "
        f"a paragraph, cut at {TRAIN_CHUNK_CHARS:,} characters) ({time.perf_counter() - t0:.1f} s)")
    langs = sorted(counts)
    probs = dict(zip(langs, language_weights([counts[x] for x in langs], alpha).tolist(),
                     strict=True))
    total = min(max_sentences, sum(counts.values()))
    rng = np.random.Generator(np.random.Philox(key=seed))
    output_prefix = Path(output_prefix)
    output_prefix.parent.mkdir(parents=True, exist_ok=True)
    model_path = output_prefix.with_name(output_prefix.name + ".model")
    threads = num_threads or os.cpu_count() or 1
    trainer = {"vocab_size": vocab_size, "character_coverage": character_coverage,
               "num_threads": threads, "hard_vocab_limit": hard_vocab_limit}
    sampled = sample_sizes(counts, probs, total)
    with tempfile.TemporaryDirectory(dir=output_prefix.parent) as tmp:
        sample_path, digest = Path(tmp) / "sample.txt", hashlib.sha256()
        with open(sample_path, "wb") as out:
            for lang, files in files_by_lang.items():
                n, k = counts[lang], sampled.get(lang, 0)
                if n == 0:
                    continue
                mult = np.full(n, k // n, dtype=np.int64)  # k > n: a small language repeated
                mult[rng.choice(n, k % n, replace=False)] += 1
                _write_sample(files, mult, out, digest, max_line_bytes)
        sample_sha256 = digest.hexdigest()
        say(f"sample for SentencePiece: {sum(sampled.values()):,} passages "
            f"({sample_path.stat().st_size / 1e6:.1f} MB), each language's share by the "
            f"weight n^{alpha:g} of its n passages: small languages repeated, large ones thinned "
            f"({time.perf_counter() - t0:.1f} s)")
        if existing == "reuse" and model_path.exists():
            if info := _existing_info(output_prefix, sample_sha256, trainer):
                return {**info, "reused": True}
            raise DataError(f"{model_path} exists and was trained from another corpus or with "
                            "other settings (or by an older version, which did not record them); "
                            "pass another --out, or --overwrite to replace it (datasets made "
                            "with it would then refuse the new one).")
        say(f"training SentencePiece: a vocabulary of {vocab_size:,} pieces, {threads} threads "
            f"(the long stage; --verbose shows its log)")
        try:
            spm.SentencePieceTrainer.train(
                input=str(sample_path), model_prefix=str(Path(tmp) / "spm"), model_type="unigram",
                vocab_size=vocab_size, character_coverage=character_coverage,
                num_threads=threads, input_sentence_size=0,
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
        say(f"trained SentencePiece ({time.perf_counter() - t0:.1f} s)")
        model = _reproducible_model((Path(tmp) / "spm.model").read_bytes(), output_prefix.name)
        atomic_write(model_path, lambda f: f.write(model))
        vocab = (Path(tmp) / "spm.vocab").read_bytes()
        atomic_write(output_prefix.with_name(output_prefix.name + ".vocab"),
                     lambda f: f.write(vocab))
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
        "sample_sha256": sample_sha256,
        "trainer": trainer,
    }
    atomic_write_json(output_prefix.with_name(output_prefix.name + ".json"), info)
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
