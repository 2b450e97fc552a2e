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
    it is a bug or a failure the message alone would not explain."""
    try:
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
