"""Loading the settings: a YAML file (plain values only) and dotted `--set section.key=value`
overrides -> Config, each value checked against its field's type; unknown keys and sections
named, with the closest known one."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

import yaml

from megatron_rembert.config import ConfigError, get_preset
from megatron_rembert.run_config.schema import SECTIONS, Config


def _coerce(value, annotation, key: str):
    """Check a YAML value against a field's type; ints are accepted for floats. Lists
    (`list[float]`) and mappings (`dict[str, float]`) are checked element by element."""
    if annotation.startswith("list["):
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, e.g. [0.0, 0.5], got {value!r}")
        return [_coerce(v, annotation[5:-1], key) for v in value]
    if annotation.startswith("dict[str, "):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, e.g. {{sw: 0.5}}, got {value!r}")
        return {str(k): _coerce(v, annotation[10:-1], f"{key}.{k}") for k, v in value.items()}
    if " | " in annotation:  # e.g. "bool | str" (model.compile: true, false or auto)
        for alternative in annotation.split(" | "):
            try:
                return _coerce(value, alternative, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {' or '.join(annotation.split(' | '))}, "
                          f"got {value!r}")
    kind = {"int": int, "float": float, "str": str, "bool": bool}[annotation]
    if kind is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:  # YAML reads "1e-3" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if (kind is not bool and isinstance(value, bool)) or not isinstance(value, kind):
        hint = f" (quote it in YAML: '{value}')" if kind is str else ""
        raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}{hint}")
    return value


def _did_you_mean(name: str, choices, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def _section_fields(section: str) -> dict:
    """The fields of a config section (model.preset included), by name."""
    fields = {f.name: f for f in dataclasses.fields(SECTIONS[section].default_factory())}
    return {"preset": None, **fields} if section == "model" else fields


def _set_field(section_obj, section: str, name: str, value) -> None:
    fields = {f.name: f for f in dataclasses.fields(section_obj)}
    if name not in fields:
        hint = _did_you_mean(name, _section_fields(section), f"{section}.")
        raise ConfigError(f"unknown key {section}.{name}{hint} (train.py --help lists every key)")
    # With postponed annotations the field types are the strings "int", "float", "str", "bool".
    setattr(section_obj, name, _coerce(value, fields[name].type, f"{section}.{name}"))


class _PlainLoader(yaml.SafeLoader):
    """safe_load without aliases: an alias (`*name`) repeats an anchored node by reference, so
    a few lines can stand for billions of values (the "billion laughs"), which anything that
    walks or prints the result (a type check, an error message) expands until memory runs
    out. A config never needs one; refused where it is read, with the line it is on."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "a YAML alias (*name): anchors and aliases are not allowed in a "
                "config (write the value out)", self.peek_event().start_mark)
        return super().compose_node(parent, index)


def _plain_yaml(text: str):
    return yaml.load(text, Loader=_PlainLoader)  # noqa: S506 - a SafeLoader subclass


def _override_value(section: str, name: str, text: str):
    """The value of `--set section.name=text`: the text itself for a string key (a folder
    named 2024 stays "2024"), else a YAML scalar (numbers, true/false)."""
    fields = _section_fields(section) if section in SECTIONS else {}
    if (section, name) == ("model", "preset") or getattr(fields.get(name), "type", None) == "str":
        return text
    try:
        return _plain_yaml(text) if text else ""
    except yaml.composer.ComposerError as err:
        raise ConfigError(f"--set {section}.{name}: {err.problem}") from None
    except yaml.YAMLError:
        return text  # not a YAML scalar: kept as text; the key's type check names it


def build_config(raw: dict, overrides: list[str] = ()) -> Config:
    """A Config from a parsed YAML dict plus `section.key=value` overrides (later wins)."""
    _check_sections(raw or {}, "config")
    raw = {k: dict(v or {}) for k, v in (raw or {}).items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. train.steps=20")
        key, text = item.split("=", 1)
        if key.count(".") != 1:
            raise ConfigError(f"--set {key}: expected SECTION.KEY, e.g. parallel.tp=2")
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = _override_value(section, name, text)
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"unknown config section {unknown[0]!r}"
                          f"{_did_you_mean(unknown[0], SECTIONS)}; expected one of "
                          f"{sorted(SECTIONS)}")
    model_raw = raw.pop("model", {})
    preset = model_raw.pop("preset", "rembert")
    config = Config(model=get_preset(preset), model_preset=preset)
    for name, value in model_raw.items():
        _set_field(config.model, "model", name, value)
    for section, values in raw.items():
        for name, value in values.items():
            _set_field(getattr(config, section), section, name, value)
    return config


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    raw = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file")
        raw = _read_yaml(path) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
        _check_sections(raw, str(path))
    return build_config(raw, overrides)


def _check_sections(raw: dict, source: str) -> None:
    for section, values in raw.items():
        if values is not None and not isinstance(values, dict):
            raise ConfigError(f"{source}: section {section!r} must be a mapping of keys, "
                              f"got {values!r}")


def _read_yaml(path: Path):
    """Plain YAML only (safe_load: no `!!python/...` tags; no aliases: `_PlainLoader`); any
    problem is one line naming the file and line."""
    try:
        return _plain_yaml(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        if "python/" in problem:
            problem = ("a !!python tag, which would build Python objects; only plain values, "
                       "lists and mappings are allowed")
        raise ConfigError(f"{path}{where}: not a valid config: {problem}") from None
