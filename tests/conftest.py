"""Test-wide settings.

Triton kernels run on CPU tensors under the interpreter; the variable must be set before
`triton` is first imported, so it is set here, before any test module is collected. A run of
the GPU tests alone (`pytest -m gpu`) leaves it unset: they run the compiled kernels.

Tests marked `gpu` need a CUDA device: without one they are skipped, with that reason (the
one rule for them, `pytest_collection_modifyitems` below).

The suite runs in two pytest-xdist workers, a test file at a time (pyproject's addopts:
`-n 2 --dist loadfile`; `-n 0` runs it in this process). Files with tests that start processes
(the long ones) are handed out first, so the two workers end together instead of one of them
finishing a long file alone; xdist's own order (files with the most tests first, which put a
one-test 2-minute file last) is off (`--no-loadscope-reorder`).

A test that starts processes (gloo ranks, torchrun, train.py or a data tool as a process,
the loader's worker processes, SLURM jobs) is marked `multiprocess`, so that
`pytest -m "not multiprocess"` is a quick loop (README, "Tests"). The mark is kept true: an
unmarked test that starts a Python process, a shell or a launcher fails and says so.
"""

import multiprocessing.process
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    if config.getoption("markexpr") != "gpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _starts_processes(item) -> bool:
    return item.get_closest_marker("multiprocess") is not None


def pytest_collection_modifyitems(config, items):
    long_files = {item.path for item in items if _starts_processes(item)}
    items.sort(key=lambda item: item.path not in long_files)  # stable: file order kept
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="gpu: no CUDA device (run `pytest -m gpu` on a GPU)")
        for item in gpu:
            item.add_marker(skip)

# Programs whose start makes a test multi-process: interpreters, shells, launchers. Compilers
# and probes that libraries run on their own (ninja, ptxas, ldconfig) are not counted.
LAUNCHERS = {"bash", "sh", "torchrun", "sbatch", "srun", "salloc", "deepspeed"}


def _program(args, kwargs) -> str:
    if kwargs.get("executable"):
        return str(kwargs["executable"])
    if kwargs.get("shell"):
        return "sh"
    if isinstance(args, (str, bytes, os.PathLike)):
        args = shlex.split(os.fsdecode(args))
    return os.fsdecode(args[0]) if args else ""


def _is_process_of_ours(program: str) -> bool:
    name = Path(program).name
    return (name in LAUNCHERS or name.startswith("python")
            or os.path.realpath(program) == os.path.realpath(sys.executable))


class _NoProcesses:
    """While active, starting a Python process, a shell or a launcher fails the test."""

    def __init__(self, nodeid: str):
        self.nodeid = nodeid
        self.saved = (subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start)

    def refuse(self, what: str):
        pytest.fail(f"{self.nodeid} starts {what}: mark it @pytest.mark.multiprocess "
                    "(tests/conftest.py)", pytrace=False)

    def __enter__(self):
        real_init, _ = self.saved
        guard = self

        def popen_init(popen, args, *rest, **kwargs):
            program = _program(args, kwargs)
            if _is_process_of_ours(program):
                guard.refuse(f"the process {Path(program).name}")
            real_init(popen, args, *rest, **kwargs)

        def start(process):
            guard.refuse(f"a {type(process).__name__}")

        subprocess.Popen.__init__ = popen_init
        multiprocessing.process.BaseProcess.start = start

    def __exit__(self, *exc):
        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = self.saved


def _guarded(item):
    if _starts_processes(item):
        yield
        return
    with _NoProcesses(item.nodeid):
        yield


# Setup included: a session fixture that starts processes, set up for an unmarked test, would
# cost the quick loop as much as the test itself.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _guarded(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _guarded(item)
