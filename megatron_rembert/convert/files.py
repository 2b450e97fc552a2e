"""Outputs of a conversion: errors, where --out may be, and atomic output folders.

- `staged_output` writes into a hidden folder next to the output and renames it at the end:
  an error or a kill leaves no half-written output. The folder gets the mode `mkdir` would
  give (the user's umask), not mkdtemp's 0700, so a cluster group can read the export.
- `check_out_apart` keeps --out away from the checkpoint's own save folder.
- `check_tp_pp`: can the model be built at --tp x --pp (the trainer's own check).
Reading and writing tensors (safetensors, guarded torch loads) is megatron_rembert/checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron_rembert.config import ConfigError, ModelConfig, check_buildable
from megatron_rembert.errors import UserError


class ConvertError(UserError):
    """Bad input or output for a conversion; the message names the file or flag."""


def check_tp_pp(model: ModelConfig, tp: int, pp: int) -> None:
    """The trainer's question (`config.check_buildable`), asked of --tp and --pp: a layout
    that cannot be built fails now, in the trainer's words, not on the cluster."""
    try:
        check_buildable(model, tp, pp)
    except ConfigError as err:
        raise ConvertError(f"--tp {tp} --pp {pp}: {err}") from err


def check_out_apart(out: str | Path, checkpoint: str | Path) -> None:
    """Refuse an --out that is, or lies inside, the checkpoint's own save folder (or holds
    it): replacing it would delete the run's checkpoints. Checked before anything is written."""
    out, folder = Path(out).resolve(), Path(checkpoint).resolve()
    save_dir = folder.parent
    if not folder.name.startswith("step_"):
        return
    if out == save_dir or out.is_relative_to(save_dir) or save_dir.is_relative_to(out):
        raise ConvertError(f"--out {out}: is or overlaps the checkpoint's own save folder "
                           f"{save_dir}; write the conversion to a separate folder")


def current_umask() -> int:
    """The process's umask (read by setting it, the only way, and restoring it at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def staged_output(out: str | Path, force: bool) -> Iterator[Path]:
    """Yield a temporary folder next to `out`; on success it replaces `out`.

    `out` must not exist or be an empty folder, unless `force` (then it is replaced).
    """
    out = Path(out)
    if out.exists():
        if not out.is_dir():
            raise ConvertError(f"--out {out}: exists and is not a folder")
        if any(out.iterdir()) and not force:
            raise ConvertError(f"--out {out}: folder is not empty; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    tmp.chmod(0o777 & ~current_umask())
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
