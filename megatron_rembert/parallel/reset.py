"""One reset for the package's process-wide state (named in parallel/state.py's docstring).

Its own module: it reaches state, comm and random, and random imports state, so living in
state.py would close an import cycle.
"""

from __future__ import annotations

from megatron_rembert.parallel import comm, random, state


def reset_process_state() -> None:
    """The package's process-wide state back to a fresh process's: no groups (one process),
    collectives on the CPU, the TP dropout stream unseeded (seeded again at its next use)."""
    state.destroy_model_parallel()
    comm.set_device("cpu")
    random.reset_tp_streams()
