"""What every command line of the package shares: one runner that turns errors into exit
codes, and plain-text tables for the console."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from megatron_rembert.errors import RunError, UserError
from megatron_rembert.fs import write_failure


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None,
            *, on_os_error: str = "") -> int:
    """Run an entry point's `main(argv)` and return its exit code (None counts as 0).

    A `UserError` (bad settings or input) becomes one `error: ...` line on stderr and exit 2;
    an `OSError` (a full disk, a read-only or lost file system) one `error: FILE: reason` line,
    followed by `on_os_error` (what to do next) if given, and exit 1; a `RunError` (a peer
    rank died or froze) its one line and exit 1. Anything else keeps its traceback (exit 1):
    it is a bug or a failure the message alone would not explain.

    Every argument must be UTF-8 text (`check_utf8`): a folder name with a byte such as 0xff
    would otherwise reach the libraries that encode paths as UTF-8 (pyarrow, sentencepiece,
    TensorBoard) and end there in a traceback."""
    try:
        check_utf8(sys.argv[1:] if argv is None else argv)
        return main(argv) or 0
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        hint = f"; {on_os_error}" if on_os_error else ""
        print(f"error: {write_failure(err)}{hint}", file=sys.stderr)
        return 1
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


class NotUTF8Error(UserError):
    """A command-line argument that is not valid UTF-8."""


def check_utf8(argv: list[str]) -> None:
    """Refuse (NotUTF8Error, naming the flag and the argument) an argument holding bytes that
    are not UTF-8: Python hands them on as lone surrogates (`os.fsdecode`), which encode
    nowhere but back to the file system."""
    for i, arg in enumerate(argv):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            raw = os.fsencode(arg)
            try:
                raw.decode("utf-8")
                bad = ""
            except UnicodeDecodeError as err:
                bad = f" (byte 0x{raw[err.start]:02x})"
            flag = f"{argv[i - 1]} " if i and argv[i - 1].startswith("-") else ""
            raise NotUTF8Error(
                f"{flag}{raw.decode('utf-8', 'backslashreplace')}: not valid UTF-8{bad}; paths "
                "and values must be UTF-8 text: rename the folder or file") from None


def prog(module_form: str) -> str:
    """The program name for usage lines: the console script's (`rembert-convert`) when run as
    one, else `module_form` (`python -m megatron_rembert.convert`, whose argv[0] is a path to
    __main__.py)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("rembert-") else module_form


def format_table(header: list[str], rows: list[list[Any]]) -> str:
    """Plain-text table with right-aligned numbers."""
    cells = [header] + [[f"{c:,}" if isinstance(c, int) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(r, widths, strict=True))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
