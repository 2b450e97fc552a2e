"""Stop requests: SIGTERM, SIGUSR1 (SLURM's warning before the time limit) and SIGINT (Ctrl-C).

train.py installs the handlers on its first line, before torch, DeepSpeed or the rest of this
package are imported, so that a signal at any moment of a rank's life is remembered instead
of killing it or raising KeyboardInterrupt. The ranks agree on the flag with one tiny
all-reduce: right after the process group is up (a request during the imports or the
rendezvous), before the first step (during the model build or the resume) and at each step
boundary, then save (at a step boundary) and exit 0; a request during start-up exits 0 with
nothing new to save. The data loader's workers leave the signals to their rank
(data/loader.py).

The job exits as the first signal asked, however many follow:
- before the save is done, a later SIGTERM / SIGUSR1 / SIGINT only sets the flag again, except
  a second Ctrl-C when the first stop request was a Ctrl-C too (half a second or more after
  it): that exits at once with 130, without saving, and `latest` still names the last complete
  checkpoint;
- once the run's last save is done (a stop's or the end's), or the run ends otherwise,
  `settle()` makes the process ignore the stop signals until it is gone: nothing changes any
  more. An ignore, not a Python handler: the interpreter's teardown puts the default action
  back for every signal that has a Python handler (CPython's signal module finalisation),
  before torch's and DeepSpeed's modules are torn down, and a signal in that window killed
  the rank (exit 128 + its number: 138 for SIGUSR1) and turned a clean stop into torchrun's
  exit 1.

A time limit (train.max_minutes, as Megatron's --exit-duration-in-mins) stops the run the same
way, at the first step boundary after it passed: the ranks agree on it in the same all-reduce
(one rank's clock past the limit stops them all). It counts from the process's start (this
module's import: train.py's first line), so it can be set from a job's wall-time limit.

This module imports only the standard library at its top: it is imported before anything else.
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
PROCESS_START = time.monotonic()  # imported on the first line of train.py


class StopFlag:
    """A flag set by the stop signals; `agreed()` is the ranks' collective answer."""

    def __init__(self):
        self.raised = False
        self.name = ""  # the first stop signal's
        self.in_use = False  # set once training begins: then settled, never restored
        self.stopping = False  # the ranks' last agreement: stop
        self.time_limit_reached = False  # ...and why: some rank's clock passed the limit
        self.deadline: float | None = None  # time.monotonic() of the time limit, if any
        self._first_interrupt: float | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def restore(self) -> None:
        """Put back the handlers found at install time (for callers that live on, e.g. tests
        calling train.main in their own process)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def settle(self) -> None:
        """The run's outcome is decided: from now on the stop signals are ignored, through
        the interpreter's teardown too (see above)."""
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.name in ("", "SIGINT"):
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

    def set_time_limit(self, minutes: float) -> None:
        """Stop `minutes` after the process started (0: no limit); see `agreed`."""
        self.deadline = PROCESS_START + 60.0 * minutes if minutes > 0 else None

    def agreed(self, time_limit: bool = False) -> bool:
        """True on every rank when any rank was signalled, or (`time_limit`: at a step
        boundary, where a stop saves) when any rank's clock passed the time limit. A
        collective: all ranks call it."""
        import torch.distributed as dist

        from megatron_rembert.parallel import comm

        late = (time_limit and self.deadline is not None
                and time.monotonic() >= self.deadline)
        signalled, timed_out = comm.all_reduce_values(
            [1.0 if self.raised else 0.0, 1.0 if late else 0.0], op=dist.ReduceOp.MAX)
        self.time_limit_reached = timed_out > 0
        self.stopping = signalled > 0 or self.time_limit_reached
        return self.stopping
