"""bench.memwatch walks /proc while processes come and go: one that exits between being
listed and being read must not end the watch (CI once failed so, in bench/full_scale.sh)."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench import memwatch

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def test_an_exited_process_has_no_children(monkeypatch):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: /proc/PID is gone
    assert memwatch._children(proc.pid) == []
    assert memwatch._tree(proc.pid) == [proc.pid]
    # The race itself: the folder was there when checked and is gone when read.
    monkeypatch.setattr(Path, "is_dir", lambda self: True)
    assert memwatch._children(proc.pid) == []


def test_children_of_a_live_process_are_found():
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                               "'import time; time.sleep(5)'])"])
    try:
        for _ in range(100):
            kids = memwatch._children(parent.pid)
            if kids:
                break
            subprocess.run(["sleep", "0.05"])
        assert len(kids) == 1 and kids[0] in memwatch._tree(parent.pid)
    finally:
        parent.kill()
        parent.wait()
