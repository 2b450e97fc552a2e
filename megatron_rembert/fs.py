"""The file system, for every package: atomic writes, sha256 while writing or of a file, the
checks of an output folder before any work, and the one rule for paths read from files
(`inside`: a name a file gives stays inside its folder).

The ground floor: torch-free and importing nothing of the package, so that the data tools, the
checkpoints, training and the converters share one implementation of each.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


# -- one rule for every failed write ----------------------------------------------------------
class WriteError(OSError):
    """A write that failed for a reason outside the program (full disk, lost mount, read-only
    file system), naming the file: `write_errors` makes every failure of a write one of these,
    which every entry point prints as one `error: FILE: reason` line (cli.run_cli, exit 1)."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


@contextmanager
def write_errors(path: str | os.PathLike) -> Iterator[None]:
    """Every write goes through this (`atomic_write`, `HashingFile`, the checkpoint engine's
    `torch.save`, the metrics logs): an `OSError` or a `RuntimeError` raised while writing
    `path` becomes a `WriteError` naming `path`. torch's writer reports a full disk as a
    RuntimeError ("PytorchStreamWriter failed writing file ... file write failed") and a
    Python file's `write()` an OSError without the file's name; either way the user sees
    which file failed and how much room is left. The outermost call names the file (an atomic
    write names its target, not its temp file). Other errors (a bug) keep their traceback."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        raise _write_error(Path(path), err) from err


def _write_error(path: Path, err: BaseException) -> WriteError:
    if isinstance(err, WriteError):
        return WriteError(err.errno, err.strerror, str(path))
    first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    reason = f"writing failed: {getattr(err, 'strerror', None) or first_line}"
    try:
        reason += f" ({shutil.disk_usage(path.parent).free / 2**30:.2f} GiB free there)"
    except OSError:
        reason += " (its folder cannot be reached: a lost mount?)"
    return WriteError(getattr(err, "errno", None) or errno.EIO, reason, str(path))


# -- writing so that a kill never leaves half of a file ----------------------------------------
def fsync_dir(path: Path) -> None:
    # A rename is durable only once the directory entry is on disk.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_file_opener(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_EXCL | os.O_NOFOLLOW, 0o666)


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None], binary: bool = True
                 ) -> None:
    """Write `path` via a temp file in the same folder, fsync, then rename: a reader (or a
    rerun after a kill) sees either the old file, no file, or the whole new file."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    with write_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)  # debris of a killed writer; a link there is removed
        # A new file, never through a link: the rename then replaces a link at `path` itself,
        # not the file it points to.
        try:
            with open(tmp, "wb" if binary else "w", opener=_new_file_opener,
                      **({} if binary else {"encoding": "utf-8"})) as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write(path, lambda f: json.dump(obj, f, indent=1, sort_keys=True), binary=False)


# -- hashing -----------------------------------------------------------------------------------
def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class HashingFile:
    """A write-only binary file that keeps the sha256 and size of what went through it.

    Given a path, it opens the file and fsyncs it on close. Given an open file (`file=`, as
    `atomic_write` passes one, which fsyncs it itself), it only passes the writes on."""

    def __init__(self, path: str | os.PathLike | None = None, file=None):
        self._own = file is None
        with write_errors(path or getattr(file, "name", "")):
            self._file = open(path, "wb") if self._own else file  # noqa: SIM115 - in close
        self.name = str(path) if self._own else getattr(file, "name", "")  # as a file has
        self._hash = hashlib.sha256()
        self.size = 0

    @property
    def closed(self) -> bool:  # pyarrow checks it before writing to a Python file object
        return self._file.closed

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self.size += len(view)
        with write_errors(self.name):
            return self._file.write(view)

    def flush(self) -> None:
        with write_errors(self.name):
            self._file.flush()

    def close(self) -> None:
        if self._own and not self._file.closed:
            try:
                with write_errors(self.name):
                    self._file.flush()
                    os.fsync(self._file.fileno())  # on disk before anything names it good
            finally:
                self._file.close()

    def record(self) -> dict:
        """The manifest entry of this file: {"size", "sha256"}."""
        return {"size": self.size, "sha256": self._hash.hexdigest()}

    def __enter__(self) -> HashingFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- output folders, checked before any work ---------------------------------------------------
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


def remove_entry(path: str | os.PathLike) -> None:
    """Remove whatever is at `path` without following a link: a link or a file is unlinked (a
    link's target is kept), a folder is removed with its contents."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


# -- paths read from files stay inside their folder --------------------------------------------
def inside(folder: str | os.PathLike, name: object, named_in: str | os.PathLike,
           error: type[Exception]) -> Path:
    """`folder / name`, where `name` was read from the file `named_in` (the step folder in a
    save folder's `latest`, a shard or the word-start table in a dataset's manifest.json, a
    file in a checkpoint's manifest.json or index): the one rule for every such path.

    Refused with `error` (the caller's UserError type), one line naming `named_in`, unless it
    stays inside `folder`: a relative name, no `..`, and resolved (every symlink followed) still
    under `folder`. Otherwise a hand-edited or copied file could make a reader train on, resume
    from or hash another run's files as its own, and a writer overwrite files elsewhere.
    """
    folder = Path(folder)
    why = None
    if not isinstance(name, str) or not name.strip() or "\0" in name:
        why = "which is not a file name"
    elif os.path.isabs(name):
        why = "an absolute path"
    elif ".." in Path(name).parts:
        why = "which climbs out with '..'"
    else:
        root, target = folder.resolve(), (folder / name).resolve()
        if target == root or root not in target.parents:
            why = (f"which leads to {target} through a symlink" if target != root
                   else "the folder itself")
    if why is not None:
        raise error(f"{named_in}: names {name!r}, {why}; a path read from this file must "
                    f"stay inside {folder} (a name relative to it, no '..', no symlink leading "
                    "out): restore the file or remove the entry")
    return folder / name
