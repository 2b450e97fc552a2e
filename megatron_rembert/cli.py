"""What every command line of the package shares: plain-text tables for the console."""

from __future__ import annotations

from typing import Any


def format_table(header: list[str], rows: list[list[Any]]) -> str:
    """Plain-text table with right-aligned numbers."""
    cells = [header] + [[f"{c:,}" if isinstance(c, int) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(r, widths, strict=True))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
