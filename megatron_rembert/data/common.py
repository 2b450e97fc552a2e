"""What the training-time data path and the preparation tools (`prep/`) share besides the
shard format: the error type, the special token ids every dataset records, and a bounded,
ordered map over a pool (the loader's worker processes, preprocessing's threads)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from megatron_rembert.errors import UserError


class DataError(UserError):
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

    def framed(self, pieces: list[int], max_length: int) -> list[int]:
        """One text as a pre-training row frames it: `[CLS] pieces [SEP]`, the pieces cut to
        max_length - 2 (what the trainer's retrieval and rembert-eval both encode)."""
        return [self.cls, *pieces[: max_length - 2], self.sep]

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> SpecialIds:
        return cls(**{k: int(d[k]) for k in ("pad", "unk", "cls", "sep", "mask")})

    def never_masked(self) -> tuple[int, ...]:
        """Ids that MLM masking must never select ([UNK] is ordinary text and may be)."""
        return (self.pad, self.cls, self.sep, self.mask)


SPECIAL_PIECES = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}


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
