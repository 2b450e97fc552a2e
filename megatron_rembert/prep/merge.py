"""Merging dataset folders made by preprocessing from disjoint sets of languages into one
folder with one manifest.json (slurm/preprocess.sbatch runs one part per array task).

Languages are packed independently, so the merged folder holds the same shards, in the same
order, as one preprocessing run over all the languages. Shards are hard-linked when the parts
are on the same file system (no extra space), copied otherwise; manifest.json is written last,
so a killed merge leaves no dataset behind and a rerun finishes it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from megatron_rembert.data.common import DataError
from megatron_rembert.data.shards import MANIFEST, read_manifest
from megatron_rembert.fs import atomic_write_json, inside

# Manifest keys that must agree between parts: they describe how every shard was made.
SAME = ("schema_version", "tokenizer", "seq_length", "special_ids", "word_starts",
        "valid_fraction")


def merge_skipped(parts: list[dict]) -> dict:
    """Counts add up; name lists are united (a stray file at the corpus root shows up in
    every part's report)."""
    merged: dict = {}
    for skipped in parts:
        for key, value in skipped.items():
            if isinstance(value, list):
                merged[key] = merged.get(key, []) + [v for v in value
                                                     if v not in merged.get(key, [])]
            else:
                merged[key] = merged.get(key, 0) + value
    return merged


def merged_manifest(parts: list[Path]) -> dict:
    manifests = [read_manifest(p) for p in parts]
    first = manifests[0]
    owner: dict[str, Path] = {}
    for part, m in zip(parts, manifests, strict=True):
        for key in SAME:
            if m[key] != first[key]:
                raise DataError(f"{part}: '{key}' differs from {parts[0]} ({m[key]} vs "
                                f"{first[key]}); merge only parts made with the same tokenizer "
                                "and preprocess.py options.")
        for lang in m["languages"]:
            if lang in owner:
                raise DataError(f"language '{lang}' is in both {owner[lang]} and {part}; "
                                "each language must be preprocessed in exactly one part.")
            owner[lang] = part
    # Sorted language order, each language's shards in their own order: what a single
    # preprocess.py run writes (it walks the corpus folders sorted by name).
    languages = {lang: row for m in manifests for lang, row in m["languages"].items()}
    shards = [s for lang in sorted(languages) for m in manifests for s in m["shards"]
              if s["language"] == lang]
    return {**first, "shards": shards, "languages": dict(sorted(languages.items())),
            "skipped": merge_skipped([m["skipped"] for m in manifests])}


def place(src: Path, dst: Path) -> None:
    """Put `src` at `dst` atomically: a hard link when possible, else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".tmp-{dst.name}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:  # another file system, or links not supported
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _destination(out: Path, name: str, part: Path) -> Path:
    """Where a file the manifest of `part` names goes in `out`: inside it, not through a link
    (read_manifest checked the name against the part; `out` may hold links of its own)."""
    return inside(out, name, part / MANIFEST, DataError)


def merge(parts: list[Path], out: Path) -> dict:
    if not parts:
        raise DataError("no part folders given; pass the folders preprocess.py wrote")
    manifest = merged_manifest(parts)
    if (out / MANIFEST).exists():
        old = read_manifest(out)
        if (old["tokenizer"] != manifest["tokenizer"]
                or not set(old["languages"]) <= set(manifest["languages"])):
            raise DataError(f"{out} already holds another dataset; merge into a new folder.")
        (out / MANIFEST).unlink()  # the folder is no dataset until the new manifest is written
    owner = {lang: part for part in parts for lang in read_manifest(part)["languages"]}
    word_starts = manifest["word_starts"]["file"]
    # Every destination is checked before anything is placed.
    moves = [(owner[e["language"]] / e["file"], _destination(out, e["file"], owner[e["language"]]))
             for e in manifest["shards"]]
    for (src, _), entry in zip(moves, manifest["shards"], strict=True):
        if not src.is_file() or src.stat().st_size != entry["bytes"]:
            raise DataError(f"{src}: missing or not the size its manifest says; rerun "
                            "preprocess.py for that part (it resumes).")
    for src, dst in [*moves, (parts[0] / word_starts, _destination(out, word_starts, parts[0]))]:
        place(src, dst)
    atomic_write_json(out / MANIFEST, manifest)
    return manifest
