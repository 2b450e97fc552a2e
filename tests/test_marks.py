"""The `multiprocess` mark stays true (tests/conftest.py): starting a Python process, a shell
or a launcher from an unmarked test fails it; a compiler or probe a library runs does not."""

import multiprocessing
import subprocess
import sys

import pytest

from tests.conftest import _NoProcesses


def test_an_unmarked_test_cannot_start_processes_of_ours():
    before = (subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start)
    with _NoProcesses("tests/x.py::test_y"):
        for start in (lambda: subprocess.run([sys.executable, "-c", "pass"]),
                      lambda: subprocess.run("echo hi", shell=True),
                      lambda: subprocess.Popen(["torchrun", "train.py"]),
                      lambda: multiprocessing.get_context("spawn").Process(target=print).start()):
            with pytest.raises(pytest.fail.Exception, match=r"tests/x.py::test_y starts .*"
                               r"mark it @pytest.mark.multiprocess"):
                start()
        assert subprocess.run(["true"]).returncode == 0  # not a process of ours
    assert (subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start) == before
