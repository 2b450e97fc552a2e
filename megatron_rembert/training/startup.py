"""Start-up stages and their times, printed by global rank 0 as each one ends.

A run spends seconds to minutes before its first step (train.py's settings, the training
imports (torch, DeepSpeed, the model), the rendezvous, the data checks, the model,
DeepSpeed's engine, the resume, the loader); each line says what just
finished and how long it took, so a slow stage shows where the time goes. Times count from the
process's start (training/signals.py), the imports included.
"""

from __future__ import annotations

import time

from megatron_rembert.training.signals import PROCESS_START


class StartupClock:
    """`mark(stage)` ends `stage` (begun where the previous one ended) and prints it on rank 0
    (`enable(rank == 0)`; off until then). `stages` keeps (stage, seconds) in order."""

    def __init__(self):
        self.stages: list[tuple[str, float]] = []
        self.last = PROCESS_START
        self.printing = False

    def enable(self, printing: bool) -> None:
        self.printing = printing

    def mark(self, stage: str) -> None:
        now = time.monotonic()
        self.stages.append((stage, now - self.last))
        self.last = now
        if self.printing:
            print(f"start-up: {stage} {self.stages[-1][1]:.1f} s", flush=True)

    def done(self) -> str:
        """The closing line: the total since the process started."""
        return (f"start-up: done in {self.last - PROCESS_START:.1f} s since the process started;"
                " the first step follows (it includes the warm-up)")


STARTUP = StartupClock()  # one per process: the loop and the engine mark their stages
