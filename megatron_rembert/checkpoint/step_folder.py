"""The step-folder protocol: how a checkpoint becomes complete, trusted, current and old.

Layout of a save folder (`train.save_dir`, or the `--out` of a conversion):
    step_00001000/          files of one checkpoint (DeepSpeed's per-rank files, or portable)
        meta.json           config, layout, step, consumed samples, tokenizer and dataset hash
        manifest.json       size and sha256 of every other file of the folder
        complete            written last, after every rank has finished
    latest                  name of the current complete folder, replaced atomically
    rolled_back/            one folder per roll-back (train.resume_from) holding the step
                            folders newer than its target, moved aside (never deleted)
    .lock                   host and pid of the run that owns the folder (see lock.py)

A step folder is checked (`complete`, a readable meta.json) once, where it is resolved: the
`StepFolder` value that results carries its meta to every reader.

A kill at any moment leaves `latest` naming the previous complete checkpoint. Folders without
`complete` are never loaded and are removed by the next successful save. Pruning never deletes
`latest` or anything newer than it. Checkpoints written before manifests existed (no
manifest.json) still load; they get no hash check, only the guarded `weights_only` loads.

Every path read from a file (the folder `latest` names, each file a manifest.json lists) must
stay inside its folder (`fs.inside`): a `latest` naming an absolute path, `..`, or a step folder
that is a symlink to another run's checkpoint is refused, never resumed from. A save never
writes through a link (`clear_save_paths`). Other entries of a save folder (a copied
`step_X.bak`, a stray file, a link) are not this protocol's: `unexpected_entries` lists them for
one notice at start-up; saving, pruning and rolling back ignore them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_rembert.checkpoint import CheckpointError
from megatron_rembert.checkpoint.lock import LOCK
from megatron_rembert.fs import (
    atomic_write,
    atomic_write_json,
    inside,
    remove_entry,
    sha256_file,
)

COMPLETE, LATEST, META, MANIFEST = "complete", "latest", "meta.json", "manifest.json"
ROLLED_BACK = "rolled_back"
# meta.json: false where the trainer wrote no DeepSpeed file (every path since version 0.2.0:
# its shard files hold the fp32 masters, the weights of record; meta.json the LR schedule)
DEEPSPEED_FILES = "deepspeed_files"
STEP_NAME = re.compile(r"step_\d{8,}")  # step_tag: 8 digits or more
# What else a save folder holds: the lock (lock.py) and the recovery scripts DeepSpeed copied
# into it at every ZeRO save of version 0.1.0; `.tmp-*` are atomic writes in flight (or debris
# of a kill).
OWN_ENTRIES = (LATEST, ROLLED_BACK, LOCK, "zero_to_fp32.py", "zero_to_torch.py")
# What meta.json must hold for a checkpoint to be read at all.
META_SECTIONS = ("config", "layout", "step", "consumed_samples")


def step_tag(step: int) -> str:
    return f"step_{step:08d}"


def step_of(folder: Path) -> int:
    """The step number of a `step_XXXXXXXX` folder name."""
    try:
        return int(folder.name.removeprefix("step_"))
    except ValueError as err:
        raise CheckpointError(f"{folder}: not a step_XXXXXXXX folder") from err


def check_step_dir(folder: str | Path) -> Path:
    """The one completeness check: the folder exists, has `complete` and a meta.json."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such folder")
    if not (folder / COMPLETE).exists():
        raise CheckpointError(f"{folder}: no '{COMPLETE}' marker: the save was interrupted or "
                              "is still running; use a complete step_* folder")
    if not (folder / META).is_file():
        raise CheckpointError(f"{folder}: no {META}; not a checkpoint folder")
    return folder


def read_meta(folder: Path) -> dict:
    """meta.json, checked against manifest.json first (a hand-edited or truncated meta.json is
    named as such before anything reads its values), then for the sections every reader
    needs."""
    path = Path(folder) / META
    check_against_manifest(Path(folder), META)
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable ({err})") from err
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: not a JSON object; the file is damaged or not ours")
    missing = [k for k in META_SECTIONS if k not in meta]
    if not isinstance(meta.get("config"), dict) or "model" not in meta.get("config", {}):
        missing.append("config.model")
    if missing:
        raise CheckpointError(f"{path}: no {', '.join(missing)} in it; the file is damaged or "
                              "not ours: restore it from a copy of the checkpoint")
    return meta


@dataclass(frozen=True)
class StepFolder:
    """A complete step folder and its meta.json, checked once where the folder is resolved
    (`open`, `find_latest`, `resolve_checkpoint`) and passed on to whatever loads it."""

    path: Path
    meta: dict

    @classmethod
    def open(cls, path: str | Path) -> StepFolder:
        folder = check_step_dir(path)
        return cls(folder, read_meta(folder))


def _latest_path(save_dir: str | Path) -> Path | None:
    """The folder `latest` names, inside `save_dir` and checked for completeness; None when
    there is none yet."""
    pointer = Path(save_dir) / LATEST
    if not pointer.exists():
        return None
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{pointer}: unreadable ({err}); point 'latest' at a complete "
                              "step_* folder or remove it") from err
    folder = inside(save_dir, name, pointer, CheckpointError)
    try:
        return check_step_dir(folder)
    except CheckpointError as err:
        raise CheckpointError(f"{pointer} names {folder}, which is not a complete checkpoint "
                              f"({err}); point "
                              "'latest' at a complete step_* folder or remove it") from err


def find_latest(save_dir: str | Path) -> StepFolder | None:
    """The checkpoint `latest` names; None when there is none yet."""
    folder = _latest_path(save_dir)
    return None if folder is None else StepFolder(folder, read_meta(folder))


def resolve_checkpoint(path: str | Path) -> StepFolder:
    """A complete step folder: `path` itself, or the folder `latest` names when `path` is a
    save folder (train.save_dir, or the --out of a conversion)."""
    path = Path(path)
    if path.is_dir() and not (path / META).exists():
        if (path / LATEST).exists():
            return find_latest(path)
        if any(path.glob("step_*")):
            raise CheckpointError(f"{path}: a save folder without '{LATEST}' (no save has "
                                  "completed); name one of its complete step_* folders")
    return StepFolder.open(path)


def step_folders(save_dir: Path) -> list[Path]:
    """The step folders of `save_dir` by step: real folders (not links) named step_XXXXXXXX."""
    return sorted((p for p in Path(save_dir).glob("step_*")
                   if STEP_NAME.fullmatch(p.name) and p.is_dir() and not p.is_symlink()),
                  key=step_of)


def unexpected_entries(save_dir: Path) -> list[str]:
    """Names in `save_dir` that are not this protocol's (a copied `step_X.bak`, a stray file,
    a link): ignored by saving, pruning and rolling back; listed for one notice."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    own = {p.name for p in step_folders(save_dir)}
    return sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "")
                  for p in save_dir.iterdir()
                  if p.name not in own and p.name not in OWN_ENTRIES
                  and not p.name.startswith(".tmp-"))


def clear_save_paths(save_dir: Path, folder: Path) -> None:
    """Before a save into `folder` (rank 0): remove what is there (a partial folder left by a
    kill at this step; a link is unlinked, its target kept), and any link at one of the save
    folder's own names: a save never writes through a link."""
    remove_entry(folder)
    for name in OWN_ENTRIES:
        if (Path(save_dir) / name).is_symlink():
            (Path(save_dir) / name).unlink()


# -- integrity ----------------------------------------------------------------------------
def _listed_files(folder: Path) -> list[str]:
    """Every file of the folder the manifest must cover (relative paths, sorted)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and p.name not in (MANIFEST, COMPLETE))


def write_manifest(folder: Path, records: dict[str, dict]) -> None:
    """`records`: {relative path: {"size", "sha256"}} hashed while writing; any other file of
    the folder (written by someone else) is hashed here."""
    files = {}
    for rel in _listed_files(folder):
        record = records.get(rel)
        if record is None or record["size"] != (folder / rel).stat().st_size:
            record = {"size": (folder / rel).stat().st_size, "sha256": sha256_file(folder / rel)}
        files[rel] = record
    atomic_write_json(folder / MANIFEST, {"version": 1, "files": files})


def _manifest_files(folder: Path) -> dict[str, dict] | None:
    """manifest.json's {relative path: {"size", "sha256"}}, None for a folder without one."""
    path = folder / MANIFEST
    if not path.exists():
        return None
    try:
        files = json.loads(path.read_text())["files"]
        if not all(isinstance(r, dict) and isinstance(r["size"], int)
                   and isinstance(r["sha256"], str) for r in files.values()):
            raise TypeError("an entry without an integer size and a sha256")
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{path}: unreadable ({err}); restore it from a copy of the "
                              "checkpoint") from err
    return files


def _check_file(folder: Path, rel: str, record: dict, path: Path, hash_it: bool = True) -> None:
    file = inside(folder, rel, path, CheckpointError)  # a name read from the manifest
    if not file.is_file():
        raise CheckpointError(f"{file}: no such file (listed in {path})")
    size = file.stat().st_size
    if size != record["size"]:
        raise CheckpointError(f"{file}: {size} bytes, {path} says {record['size']}: the "
                              "file is truncated or replaced; restore it from a copy")
    if hash_it and sha256_file(file) != record["sha256"]:
        raise CheckpointError(f"{file}: sha256 differs from {path}: the file is corrupt, "
                              "edited or replaced; restore it from a copy")


def check_against_manifest(folder: Path, rel: str) -> None:
    """One file of the folder against manifest.json (nothing to check without a manifest)."""
    files = _manifest_files(folder)
    if files is None:
        return
    if rel not in files:
        raise CheckpointError(f"{folder / rel}: not in {folder / MANIFEST}; a file added after "
                              "the save is not trusted: restore the folder from a copy")
    _check_file(folder, rel, files[rel], folder / MANIFEST)


def verify(folder: Path, share: tuple[int, int] = (0, 1)) -> bool:
    """Check every file against manifest.json before anything is unpickled; False when the
    folder predates manifests. Raises naming the first file that differs.

    share=(i, n): hash only every n-th file starting at i (n processes split the reading);
    sizes and the file list are checked in full by everyone."""
    path = folder / MANIFEST
    files = _manifest_files(folder)
    if files is None:
        return False
    unlisted = sorted(set(_listed_files(folder)) - set(files))
    if unlisted:
        raise CheckpointError(f"{folder / unlisted[0]}: not in {path}; a file added after the "
                              "save is not trusted: remove it")
    for i, (rel, record) in enumerate(sorted(files.items())):
        _check_file(folder, rel, record, path, hash_it=i % share[1] == share[0])
    return True


# -- committing, pruning, rolling back ------------------------------------------------------
def commit(save_dir: Path, folder: Path, meta: dict, records: dict[str, dict],
           keep_last: int | None = None) -> None:
    """Make `folder` the current checkpoint (one process): meta.json, manifest.json,
    `complete`, then `latest` (the atomic step), then prune to `keep_last` if given."""
    atomic_write_json(folder / META, meta)
    write_manifest(folder, records)
    atomic_write(folder / COMPLETE, lambda f: None)
    atomic_write(save_dir / LATEST, lambda f: f.write(folder.name + "\n"), binary=False)
    if keep_last is not None:
        prune(save_dir, keep_last)


def prune(save_dir: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete folders up to `latest`; never touch `latest` or a
    folder newer than it; remove incomplete folders older than `latest` (debris of a kill)."""
    current = _latest_path(save_dir)
    if current is None:
        return
    newest = step_of(current)
    folders = step_folders(save_dir)
    older = [p for p in folders if step_of(p) <= newest]
    complete = [p for p in older if (p / COMPLETE).exists()]
    for p in older:
        if not (p / COMPLETE).exists():
            shutil.rmtree(p, ignore_errors=True)
    for p in complete[: max(0, len(complete) - max(1, keep_last))]:
        if p != current:
            shutil.rmtree(p, ignore_errors=True)


def roll_back(save_dir: Path, target: Path) -> list[Path] | None:
    """Make `target` (a complete step folder of `save_dir`) current; every newer step folder
    is moved into `save_dir/rolled_back/<time>_to_<name>/`, not deleted. Returns where they
    went, or None when a roll-back to `target` was done before: a restart (a requeued job)
    with the same setting must not undo the progress made since."""
    target = check_step_dir(target).resolve()
    save_dir = Path(save_dir).resolve()
    if target.parent != save_dir:
        raise CheckpointError(f"train.resume_from={target}: not a step folder of "
                              f"train.save_dir={save_dir}")
    if list((save_dir / ROLLED_BACK).glob(f"*_to_{target.name}")):
        return None
    newer = [p for p in step_folders(save_dir) if step_of(p) > step_of(target)]
    aside = save_dir / ROLLED_BACK / f"{time.strftime('%Y%m%d-%H%M%S')}_to_{target.name}"
    aside.mkdir(parents=True)  # also the record that this roll-back was done
    for p in newer:
        os.replace(p, aside / p.name)
    atomic_write(save_dir / LATEST, lambda f: f.write(target.name + "\n"), binary=False)
    return [aside / p.name for p in newer]
