"""A console progress bar for the preparation tools (preprocessing)."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    """A one-line progress bar on stderr, redrawn at most every `interval` seconds."""

    def __init__(self, total: int, label: str = "", interval: float = 0.5, enabled: bool = True):
        self.total, self.label = max(total, 1), label
        self.enabled = enabled and sys.stderr is not None
        # In a log file (SLURM) redraws would pile up: one plain line every 30 s instead.
        self.tty = self.enabled and sys.stderr.isatty()
        self.interval = interval if self.tty else 30.0
        self.done, self.start, self._last = 0, time.monotonic(), 0.0
        self.note = ""

    def update(self, done: int, note: str = "", force: bool = False) -> None:
        self.done, self.note = done, note
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < self.interval):
            return
        self._last = now
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        elapsed = now - self.start
        rate = self.done / max(elapsed, 1e-9)
        eta = _clock((self.total - self.done) / rate) if rate > 0 else "?"
        line = (f"{self.label} [{bar:<30}] {100 * frac:5.1f}% {rate / 1e6:6.1f} MB/s "
                f"elapsed {_clock(elapsed)} eta {eta} {self.note}")
        sys.stderr.write(f"\r{line}\x1b[K" if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        self.update(self.done, self.note, force=True)
        if self.tty:
            sys.stderr.write("\n")


def _clock(seconds: float) -> str:
    minutes, sec = divmod(int(max(seconds, 0)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{sec:02d}"
