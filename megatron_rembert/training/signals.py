"""Stop requests: SIGTERM, SIGUSR1 (SLURM's warning before the time limit) and SIGINT (Ctrl-C).

Installed before any heavy import, so that a signal during start-up is remembered instead of
killing the rank. The ranks agree on the flag at each step boundary (and once before the
first step) with one tiny all-reduce, then save and exit 0; a request during start-up exits 0
with nothing new to save. A second Ctrl-C exits at once with 130, without saving: `latest`
still names the last complete checkpoint. Repeated SIGTERM / SIGUSR1 only set the flag again.
"""

from __future__ import annotations

import os
import signal
import sys
import time

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# A Ctrl-C reaches a rank twice a few milliseconds apart under torchrun (from the terminal
# and passed on by torchrun); within this many seconds it counts as one press.
SAME_PRESS_S = 0.5
INTERRUPTED = 130  # exit code of a second Ctrl-C, as a shell reports a process killed by it


class StopFlag:
    """A flag set by the stop signals; `agreed()` is the ranks' collective answer."""

    def __init__(self):
        self.raised = False
        self.name = ""
        self._first_interrupt: float | None = None
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_interrupt is None:
                self._first_interrupt = now
            elif now - self._first_interrupt > SAME_PRESS_S:
                sys.stdout.flush()
                sys.stderr.write("second Ctrl-C: exiting now without saving; the last complete "
                                 "checkpoint is kept\n")
                sys.stderr.flush()
                os._exit(INTERRUPTED)
        self.raised = True
        self.name = self.name or signal.Signals(signum).name

    def agreed(self) -> bool:
        """True on every rank when any rank was signalled (a collective: all ranks call it)."""
        import torch.distributed as dist

        from megatron_rembert.parallel import comm

        (flag,) = comm.all_reduce_values([1.0 if self.raised else 0.0], op=dist.ReduceOp.MAX)
        return flag > 0
