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


GPU_TEST_FILES = ["tests/bench/test_gpu_checks.py", "tests/kernels/test_aot_compile.py"]


@pytest.mark.multiprocess
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is here")
def test_gpu_tests_are_collected_and_skipped_without_cuda():
    """`pytest -m gpu` without CUDA: every GPU test is collected, none runs, each skip says
    why (the conftest rule), and the run passes; the other tests are deselected."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-rs", "-q", "-n", "0",
                          "-p", "no:cacheprovider", *GPU_TEST_FILES], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:]
    skips = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    counted = sum(int(line.split("[")[1].split("]")[0]) for line in skips)
    assert counted >= 8 and f"{counted} skipped, " in run.stdout, run.stdout[-3000:]
    assert all("gpu: no CUDA device" in line for line in skips), skips
    assert " passed" not in run.stdout and " failed" not in run.stdout
