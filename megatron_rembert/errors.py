"""The one base type of the errors a user can fix, on the ground floor so every package can
derive its own from it.

`ConfigError` (config.py), `DataError` (data/common.py), `CheckpointError` (checkpoint/),
`ConvertError` (convert/files.py), `PlotError` (plot.py) and `DivergenceError`
(training/divergence.py: a run diverged, mostly from its settings) are `UserError`s: bad
settings or input, whose message names the key, flag or file and says how to fix it. Every
entry point prints one as a single `error: ...` line and exits 2 (`cli.run_cli`). They are not
`RuntimeError`s or `ValueError`s, so that nothing that catches those (or classifies them, as
`training.hang.is_collective_failure` does torch's) can take a user error for something else.

`RunError` is the other kind of failure that one line explains (a peer that died or froze):
one `error: ...` line too, but exit 1.
"""


class UserError(Exception):
    """Bad settings or input; the message names what was wrong and how to fix it."""


class RunError(Exception):
    """A run that failed for a reason its message fully explains, not a bug and not bad input:
    a peer rank that died, froze or stopped with its own error (each rank names its own
    position). Printed as one `error: ...` line with exit 1 (`cli.run_cli`), no traceback."""
