"""Small helpers shared by the data tools: errors, special ids, a bounded ordered map over a
process pool and a console progress bar."""

from __future__ import annotations

import collections
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any


class DataError(RuntimeError):
    """Bad input or a dataset that does not match what it should be. The message names the
    file (or flag) and says how to fix it."""


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the special tokens. Fixed by `train_tokenizer.py`; every dataset records them."""

    pad: int = 0
    unk: int = 1
    cls: int = 2
    sep: int = 3
    mask: int = 4

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> SpecialIds:
        return cls(**{k: int(d[k]) for k in ("pad", "unk", "cls", "sep", "mask")})

    def never_masked(self) -> tuple[int, ...]:
        """Ids that MLM masking must never select ([UNK] is ordinary text and may be)."""
        return (self.pad, self.cls, self.sep, self.mask)


SPECIAL_PIECES = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}


def usable_cpus() -> int:
    """The CPUs this process may run on (a SLURM job's share, not the whole node)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Ready:
    """A value already at hand, with the method ordered_map waits on (as a pool's result)."""

    def __init__(self, value: Any = None):
        self.value = value

    def get(self) -> Any:
        return self.value


def ordered_map(
    submit: Callable[[Any], Any], items: Iterable[Any], max_in_flight: int
) -> Iterator[Any]:
    """Yield `(item, submit(item).get())` in input order, keeping at most `max_in_flight`
    tasks queued. `Pool.imap` would read `items` to the end first, which for a 100 GB corpus (or an
    endless sample stream) means unbounded memory."""
    pending: collections.deque = collections.deque()
    for item in items:
        pending.append((item, submit(item)))
        if len(pending) >= max_in_flight:
            done, handle = pending.popleft()
            yield done, handle.get()
    while pending:
        done, handle = pending.popleft()
        yield done, handle.get()


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


def format_table(header: list[str], rows: list[list[Any]]) -> str:
    """Plain-text table with right-aligned numbers."""
    cells = [header] + [[f"{c:,}" if isinstance(c, int) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(r, widths, strict=True))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
