"""Held-out parallel text for retrieval: a folder with one file per language.

    <lang>.jsonl   one object per line: {"id": ..., "text": "<lang text>", "en": "<English>"}
                   (other fields ignored)
    <lang>.tsv     one pair per line: <lang text> TAB <English>

Row i of a language's `text` translates row i of its `en`. Blank lines are skipped. Read at
start-up by the config checks (run_config.check_settings) and by the trainer's periodic
retrieval (training/retrieval.py); any problem is one DataError line naming the file and line.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rembert.data.common import DataError

SUFFIXES = (".jsonl", ".tsv")


def read_parallel_set(folder: str | Path, max_pairs: int, key: str = "eval.retrieval_path"
                      ) -> dict[str, list[tuple[str, str]]]:
    """{lang: [(text, en), ...]}: the first `max_pairs` pairs of each `<lang>.jsonl` or
    `<lang>.tsv` of `folder`, languages sorted. `key`: the setting that named the folder, for
    the error messages."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{key}={folder}: no such folder (a folder of <lang>.jsonl files, "
                        "each line {\"text\": ..., \"en\": ...})")
    files: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix not in SUFFIXES or not path.is_file():
            continue
        if path.stem in files:
            raise DataError(f"{key}={folder}: {files[path.stem].name} and {path.name} both "
                            f"give language {path.stem!r}; keep one")
        files[path.stem] = path
    if not files:
        raise DataError(f"{key}={folder}: no <lang>.jsonl or <lang>.tsv files there")
    return {lang: _read_file(path, max_pairs) for lang, path in files.items()}


def _read_file(path: Path, max_pairs: int) -> list[tuple[str, str]]:
    pairs = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if len(pairs) >= max_pairs:
                    break
                if line.strip():
                    pairs.append(_parse(line.rstrip("\r\n"), path, number))
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start} of a "
                        "line)") from None
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from None
    if not pairs:
        raise DataError(f"{path}: no pairs (empty file)")
    return pairs


def _parse(line: str, path: Path, number: int) -> tuple[str, str]:
    where = f"{path}:{number}"
    if path.suffix == ".tsv":
        fields = line.split("\t")
        if len(fields) != 2:
            raise DataError(f"{where}: expected <text> TAB <English text>, found "
                            f"{len(fields)} tab-separated fields")
        text, en = fields
    else:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: not a JSON object ({err.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object with \"text\" and \"en\"")
        text, en = row.get("text"), row.get("en")
        for name, value in (("text", text), ("en", en)):
            if not isinstance(value, str):
                raise DataError(f"{where}: field {name!r} missing or not a string")
    if not text.strip() or not en.strip():
        raise DataError(f"{where}: an empty side; every pair needs both texts")
    return text, en
