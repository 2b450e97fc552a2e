"""Held-out parallel text for retrieval: a folder with one file per language.

    <lang>.jsonl   one object per line: {"id": ..., "text": "<lang text>", "en": "<English>"}
                   (other fields ignored)
    <lang>.tsv     one pair per line: <lang text> TAB <English>

Row i of a language's `text` translates row i of its `en`. Blank lines are skipped. The one
reader of the format, with one set of rules, for both of its users: the trainer's periodic
retrieval (eval.retrieval_path, checked at start-up by run_config.checks.check_settings; read by
training/retrieval.py) and the offline `rembert-eval --parallel` (eval/). So a figure logged
while training and the offline one, at the same number of pairs, are measured on the same pairs.

- Any problem is one DataError line naming the file and line (or the folder).
- Duplicates: a pair whose language text or whose English text equals an earlier pair's is
  dropped (the first is kept, the count reported). With two equal texts on one side, two
  candidates have the same embedding and the tie would decide the score, not the model. A pair
  whose two sides are equal (an untranslated sentence) is kept and counted: every model scores
  it perfectly, so the count says how far the figures are inflated.
- Subset: of a language with more than `max_pairs` pairs (after dropping duplicates), a fixed
  random subset of `max_pairs`, drawn from the language's name (`subset`), in file order.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_rembert.data.common import DataError

SUFFIXES = (".jsonl", ".tsv")
SUBSET_SEED = 0  # one subset for every reader: changing it changes every logged figure


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


def subset(n: int, limit: int, lang: str) -> np.ndarray:
    """Sorted indices of a deterministic subset of `limit` of `n` rows (all when n <= limit),
    drawn from (SUBSET_SEED, language): the same pairs on every run and machine."""
    if n <= limit:
        return np.arange(n)
    rng = np.random.default_rng([SUBSET_SEED, zlib.crc32(lang.encode())])
    return np.sort(rng.choice(n, size=limit, replace=False))


def read_parallel_set(folder: str | Path, max_pairs: int, named: str | None = None
                      ) -> list[ParallelSet]:
    """Every `<lang>.jsonl` / `<lang>.tsv` of `folder`, languages sorted; duplicates dropped,
    then at most `max_pairs` pairs per language (module docstring). `named`: how the user
    named the folder, for the messages (default `eval.retrieval_path=<folder>`; the eval
    command passes `--parallel <folder>`)."""
    folder = Path(folder)
    named = named or f"eval.retrieval_path={folder}"
    if not folder.is_dir():
        raise DataError(f"{named}: no such folder (a folder of <lang>.jsonl files, each line "
                        "{\"text\": ..., \"en\": ...}, or of <lang>.tsv files)")
    files: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix not in SUFFIXES or not path.is_file():
            continue
        if path.stem in files:
            raise DataError(f"{named}: {files[path.stem].name} and {path.name} both give "
                            f"language {path.stem!r}; keep one")
        files[path.stem] = path
    if not files:
        raise DataError(f"{named}: no <lang>.jsonl or <lang>.tsv files there")
    return [_language(lang, path, max_pairs) for lang, path in files.items()]


def _language(lang: str, path: Path, max_pairs: int) -> ParallelSet:
    pairs = _read_file(path)
    texts, english, seen_t, seen_e = [], [], set(), set()
    for t, e in pairs:
        if t in seen_t or e in seen_e:
            continue
        seen_t.add(t)
        seen_e.add(e)
        texts.append(t)
        english.append(e)
    keep = subset(len(texts), max_pairs, lang)
    kept_t, kept_e = [texts[i] for i in keep], [english[i] for i in keep]
    same = sum(a == b for a, b in zip(kept_t, kept_e, strict=True))
    return ParallelSet(lang, path, kept_t, kept_e, read=len(pairs),
                       duplicates_dropped=len(pairs) - len(texts), identical_pairs=same)


def _read_file(path: Path) -> list[tuple[str, str]]:
    """Every pair of one file, in order; read in bytes so that a line that is not UTF-8 is
    named by its number."""
    pairs = []
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as err:
                    raise DataError(f"{path}:{number}: not UTF-8 text ({err.reason} at byte "
                                    f"{err.start} of the line)") from None
                if line.strip():
                    pairs.append(_parse(line, path, number))
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from None
    if not pairs:
        raise DataError(f"{path}: no pairs (an empty file)")
    return pairs


def _parse(line: str, path: Path, number: int) -> tuple[str, str]:
    where = f"{path}:{number}"
    if path.suffix == ".tsv":
        fields = line.split("\t")
        if len(fields) != 2:
            raise DataError(f"{where}: expected <text> TAB <English text>, found "
                            f"{len(fields)} tab-separated fields")
        row = dict(zip(("text", "en"), fields, strict=True))
    else:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: not a JSON object ({err.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object with \"text\" and \"en\", got "
                            f"{type(row).__name__}")
    for name in ("text", "en"):
        if name not in row:
            raise DataError(f"{where}: missing field {name!r}")
        if not isinstance(row[name], str):
            raise DataError(f"{where}: field {name!r} must be a string, got "
                            f"{type(row[name]).__name__}")
        if not row[name].strip():
            raise DataError(f"{where}: field {name!r} is empty (every pair needs both texts)")
    return row["text"], row["en"]
