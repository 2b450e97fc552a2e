"""Reading the evaluation sets (docs/eval.md, "Input formats"), checked before any model loads.

- Parallel sets for retrieval: a folder of `<lang>.jsonl` files, one pair per line,
  `{"id": str, "text": "<lang text>", "en": "<English text>"}` (other fields ignored), or of
  `<lang>.tsv` files, `text<TAB>en` per line (blank lines skipped).
- Topic classification: a JSON-lines file, `{"id", "lang", "label", "text"}` per line.

Duplicates in a parallel set: a pair whose language text or whose English text equals an
earlier pair's is dropped (the first is kept, the count reported). With two equal texts on one
side, two candidates have the same embedding and the tie would decide the score, not the
model. A pair whose two sides are equal (an untranslated sentence) is kept and counted:
every model scores it perfectly, so the count says how far the figures are inflated.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_rembert.errors import UserError


class EvalDataError(UserError):
    """An evaluation set that cannot be read; the message names the file and line or field."""


@dataclass
class ParallelSet:
    """One language's pairs with English, after dropping duplicates and subsetting."""

    lang: str
    file: Path
    texts: list[str]  # the language's side
    english: list[str]  # row i translates texts[i]
    read: int = 0  # pairs in the file
    duplicates_dropped: int = 0
    identical_pairs: int = 0  # pairs kept whose two sides are the same text

    def __len__(self) -> int:
        return len(self.texts)


@dataclass
class Example:
    lang: str
    label: str
    text: str


@dataclass
class ClassificationSet:
    file: Path
    examples: list[Example] = field(default_factory=list)

    def languages(self) -> list[str]:
        return sorted({e.lang for e in self.examples})


def _text(value, where: str, name: str) -> str:
    if not isinstance(value, str):
        raise EvalDataError(f"{where}: field {name!r} must be a string, got "
                            f"{type(value).__name__}")
    if not value.strip():
        raise EvalDataError(f"{where}: field {name!r} is empty")
    return value


def _json_lines(path: Path):
    """(line number, object) of every non-blank line of a JSON-lines file."""
    if not path.is_file():
        raise EvalDataError(f"{path}: no such file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise EvalDataError(f"{path}: not UTF-8 text ({err})") from err
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise EvalDataError(f"{path}:{number}: not a JSON line ({err.msg})") from err
        if not isinstance(obj, dict):
            raise EvalDataError(f"{path}:{number}: expected a JSON object, got "
                                f"{type(obj).__name__}")
        yield number, obj


def _read_pairs(path: Path) -> list[tuple[str, str]]:
    pairs = []
    if path.suffix == ".jsonl":
        for number, obj in _json_lines(path):
            where = f"{path}:{number}"
            for key in ("text", "en"):
                if key not in obj:
                    raise EvalDataError(f"{where}: missing field {key!r}")
            pairs.append((_text(obj["text"], where, "text"), _text(obj["en"], where, "en")))
        return pairs
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise EvalDataError(f"{path}: not UTF-8 text ({err})") from err
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        cells = line.split("\t")
        if len(cells) != 2:
            raise EvalDataError(f"{path}:{number}: expected 'text<TAB>en' (2 columns), got "
                                f"{len(cells)}")
        where = f"{path}:{number}"
        pairs.append((_text(cells[0], where, "text"), _text(cells[1], where, "en")))
    return pairs


def subset(n: int, limit: int, seed: int, lang: str) -> np.ndarray:
    """Sorted indices of a deterministic subset of `limit` of `n` rows (all when n <= limit),
    drawn from (seed, language): the same pairs on every run and machine."""
    if n <= limit:
        return np.arange(n)
    rng = np.random.default_rng([seed, zlib.crc32(lang.encode())])
    return np.sort(rng.choice(n, size=limit, replace=False))


def read_parallel(folder: str | Path, max_pairs: int, seed: int = 0) -> list[ParallelSet]:
    """Every `<lang>.jsonl` / `<lang>.tsv` of `folder`, by language; duplicates dropped (module
    docstring), then at most `max_pairs` pairs per language (`subset`)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise EvalDataError(f"--parallel {folder}: no such folder")
    files = sorted(p for p in folder.iterdir() if p.suffix in (".jsonl", ".tsv")
                   and p.is_file())
    if not files:
        raise EvalDataError(f"--parallel {folder}: no <lang>.jsonl or <lang>.tsv files")
    sets, seen_langs = [], {}
    for path in files:
        lang = path.stem
        if lang in seen_langs:
            raise EvalDataError(f"--parallel {folder}: both {seen_langs[lang].name} and "
                                f"{path.name} give language {lang!r}; keep one")
        seen_langs[lang] = path
        pairs = _read_pairs(path)
        if not pairs:
            raise EvalDataError(f"{path}: no pairs (an empty set)")
        texts, english, seen_t, seen_e = [], [], set(), set()
        for t, e in pairs:
            if t in seen_t or e in seen_e:
                continue
            seen_t.add(t)
            seen_e.add(e)
            texts.append(t)
            english.append(e)
        keep = subset(len(texts), max_pairs, seed, lang)
        kept_t, kept_e = [texts[i] for i in keep], [english[i] for i in keep]
        same = sum(a == b for a, b in zip(kept_t, kept_e, strict=True))
        sets.append(ParallelSet(lang, path, kept_t, kept_e, read=len(pairs),
                                duplicates_dropped=len(pairs) - len(texts), identical_pairs=same))
    return sets


def read_classification(path: str | Path, flag: str) -> ClassificationSet:
    """A `{"id", "lang", "label", "text"}` JSON-lines file. Labels are compared as text (1
    and "1" are one label)."""
    path = Path(path)
    if not path.is_file():
        raise EvalDataError(f"{flag} {path}: no such file")
    out = ClassificationSet(path)
    for number, obj in _json_lines(path):
        where = f"{path}:{number}"
        for key in ("lang", "label", "text"):
            if key not in obj:
                raise EvalDataError(f"{where}: missing field {key!r}")
        label = obj["label"]
        if isinstance(label, bool) or not isinstance(label, (str, int)):
            raise EvalDataError(f"{where}: field 'label' must be a string or an integer, got "
                                f"{type(label).__name__}")
        out.examples.append(Example(_text(obj["lang"], where, "lang"), str(label),
                                    _text(obj["text"], where, "text")))
    if not out.examples:
        raise EvalDataError(f"{flag} {path}: no examples (an empty set)")
    return out
