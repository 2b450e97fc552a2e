"""A plain-text progress line on stderr (`\\r` redraws on a terminal, a line per stage in a
log file), without a dependency."""

from __future__ import annotations

import sys
import time


class Progress:
    """Counts work units of a whole evaluation; `stage` names what runs now."""

    def __init__(self, total: int, enabled: bool = True, interval: float = 0.2):
        self.total, self.done = max(total, 1), 0
        self.enabled = enabled and sys.stderr is not None
        self.tty = self.enabled and sys.stderr.isatty()
        self.interval, self.start, self._last = interval, time.monotonic(), 0.0
        self.stage = ""

    def set_stage(self, stage: str) -> None:
        self.stage = stage
        if self.enabled and not self.tty:
            sys.stderr.write(f"[{self.done / self.total:4.0%}] {stage}\n")
            sys.stderr.flush()
        self._draw(force=True)

    def advance(self, units: int = 1) -> None:
        self.done += units
        self._draw()

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.tty or (not force and now - self._last < self.interval):
            return
        self._last = now
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 24)
        elapsed = int(now - self.start)
        sys.stderr.write(f"\r[{bar:<24}] {frac:4.0%} {elapsed // 60}:{elapsed % 60:02d} "
                         f"{self.stage}\x1b[K")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            self._draw(force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()
