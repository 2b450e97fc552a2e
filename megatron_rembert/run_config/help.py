"""`train.py --help`'s list of config keys, built from the sections' fields: each key's
default, its allowed values (RANGES, CHOICES) and its help text (the field's
metadata["help"], given by `config.setting`)."""

from __future__ import annotations

import dataclasses

from megatron_rembert.config import choice_text
from megatron_rembert.run_config.schema import CHOICES, RANGES, SECTIONS, Config


def config_help() -> str:
    """Every key with its default, the values it may take and its help text."""
    lines = ["config keys (section.key = default, allowed values; numbers must be finite):",
             "  model.preset = rembert  (one of the presets in megatron_rembert/config.py; "
             "other model.* keys override it)"]
    default = Config()
    for section in SECTIONS:
        values = getattr(default, section)
        for f in dataclasses.fields(values):
            key = f"{section}.{f.name}"
            allowed = (f"  {RANGES[key]}" if key in RANGES else
                       f"  {' | '.join(map(choice_text, CHOICES[key]))}" if key in CHOICES
                       else "")
            lines.append(f"  {key} = {getattr(values, f.name)}{allowed}  ({f.metadata['help']})")
    return "\n".join(lines)
