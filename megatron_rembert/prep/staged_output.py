"""An output folder whose files appear together: written into `OUT/.incomplete/` first and
moved into place only when the whole run succeeded, its summary last.

A run that fails (bad input found late, a full disk, a kill) leaves the previous output as it
was, apart from the staging folder, which the next run removes. A rerun replaces the files of
a previous run and removes those it no longer writes (a language left out this time), so OUT
always holds one run's output. OUT may hold only files of the tool's layout (`owned`):
anything else means OUT is not ours, and `foreign_entries` names it before any work.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from megatron_rembert.data.common import DataError
from megatron_rembert.fs import atomic_write, fsync_dir, remove_entry, write_errors

STAGE = ".incomplete"
_DEBRIS = re.compile(r"(.*/)?\.tmp-\d+-[^/]*")  # a killed atomic_write's temp file


def foreign_entries(out: Path, owned: re.Pattern) -> list[str]:
    """Paths under `out` (relative, sorted) that are neither `owned` files, the staging folder,
    nor the debris of an atomic write: non-empty means `out` is not this tool's output. A
    symlink inside `out` is always foreign (a rerun must never write through one); `out`
    itself may be one."""
    if not out.exists():
        return []
    if not out.is_dir():
        return ["."]
    foreign = []
    for folder, dirs, files in os.walk(out):
        rel = Path(folder).relative_to(out)
        for name in list(dirs):
            if (Path(folder) / name).is_symlink():
                foreign.append((rel / name).as_posix())
            if (Path(folder) / name).is_symlink() or (rel / name).as_posix() == STAGE:
                dirs.remove(name)  # a link is not followed; the stage is removed whole
        for name in files:
            path = (rel / name).as_posix()
            if (Path(folder) / name).is_symlink() or not (
                    owned.fullmatch(path) or _DEBRIS.fullmatch(path)):
                foreign.append(path)
    return sorted(foreign)


class StagedOutput:
    """Write files (relative paths under `out`), then `commit` or `abort`."""

    def __init__(self, out: str | os.PathLike, owned: re.Pattern):
        self.out, self.owned = Path(out), owned
        self.stage = self.out / STAGE
        self.written: dict[str, dict] = {}

    def begin(self) -> None:
        """Refuse an `out` holding anything but owned files (DataError), then make the stage."""
        if foreign := foreign_entries(self.out, self.owned):
            raise DataError(f"{self.out} holds files this command did not write "
                            f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                            "choose a new or empty folder")
        with write_errors(self.stage):
            remove_entry(self.stage)  # a killed run's leftovers
            self.stage.mkdir(parents=True)

    def write_lines(self, rel: str, lines: list[str]) -> dict:
        """Stage a UTF-8 text file of `lines`, each ended by a newline; returns its record
        {"lines", "sha256"} (also kept in `written`)."""
        data = "".join(f"{line}\n" for line in lines).encode("utf-8")
        atomic_write(self.stage / rel, lambda f: f.write(data))
        self.written[rel] = {"lines": len(lines), "sha256": hashlib.sha256(data).hexdigest()}
        return self.written[rel]

    def commit(self, summary_name: str, summary: bytes) -> None:
        """Move every staged file into place, remove owned files this run did not write, then
        write `summary_name` (the mark of a complete output) and drop the stage."""
        summary_path = self.out / summary_name
        with write_errors(summary_path):
            summary_path.unlink(missing_ok=True)  # from here until the end, OUT is in between
        for rel in sorted(self.written):
            target = self.out / rel
            with write_errors(target):
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(self.stage / rel, target)
                fsync_dir(target.parent)
        self._remove_stale(summary_name)
        atomic_write(summary_path, lambda f: f.write(summary))
        remove_entry(self.stage)

    def abort(self) -> None:
        remove_entry(self.stage)

    def _remove_stale(self, summary_name: str) -> None:
        for folder, _dirs, files in os.walk(self.out, topdown=False):
            rel = Path(folder).relative_to(self.out)
            if rel.parts[:1] == (STAGE,):
                continue
            for name in files:
                path = (rel / name).as_posix()
                if path != summary_name and path not in self.written and (
                        self.owned.fullmatch(path) or _DEBRIS.fullmatch(path)):
                    with write_errors(Path(folder) / name):
                        (Path(folder) / name).unlink()
            if rel != Path(".") and not any(Path(folder).iterdir()):
                Path(folder).rmdir()  # a language folder left empty
