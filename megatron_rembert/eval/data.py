"""Reading the classification sets (docs/eval.md, "Input formats"), checked before any model
loads: a JSON-lines file, `{"id", "lang", "label", "text"}` per line. (The parallel sets for
retrieval have their own reader, shared with the trainer: data/parallel_text.py.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rembert.errors import UserError


class EvalDataError(UserError):
    """An evaluation set that cannot be read; the message names the file and line or field."""


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
