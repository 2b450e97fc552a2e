"""Output folders checked before any work: a folder (or one that can be made) we can write in."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def unwritable_reason(path: str | os.PathLike) -> str | None:
    """Why files could not be written in the folder `path` (made if missing), or None.

    The nearest existing ancestor must be a folder, and a probe file is created and removed
    there: a real write, since `os.access` says yes to root on a read-only file system.
    """
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:
        handle, probe = tempfile.mkstemp(prefix=".write-test-", dir=existing)
    except OSError as err:
        return f"cannot write in {existing} ({err.strerror})"
    os.close(handle)
    os.remove(probe)
    return None


def is_inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """`path` is `folder` or lies under it (symlinks resolved)."""
    path, folder = Path(path).resolve(), Path(folder).resolve()
    return path == folder or folder in path.parents


def write_failure(err: OSError) -> str:
    """One line for a file-system failure while writing (full disk, read-only, lost mount)."""
    where = f"{err.filename}: " if err.filename else ""
    return f"{where}{err.strerror or err}"
