"""One runner for every entry point: a user error is one `error:` line and exit 2, a failing
file system one line naming the file and exit 1, anything else keeps its traceback."""

import errno

import pytest

from megatron_rembert.checkpoint import CheckpointError
from megatron_rembert.cli import run_cli
from megatron_rembert.config import ConfigError
from megatron_rembert.convert.files import ConvertError
from megatron_rembert.data.common import DataError
from megatron_rembert.errors import UserError
from megatron_rembert.plot import PlotError


def _failing(err: BaseException):
    def main(argv):
        raise err
    return main


@pytest.mark.parametrize("kind", [ConfigError, DataError, CheckpointError, ConvertError,
                                  PlotError])
def test_user_errors_are_one_line_and_exit_2(kind, capsys):
    assert issubclass(kind, UserError)
    assert not issubclass(kind, (RuntimeError, ValueError))  # never taken for torch's errors
    assert run_cli(_failing(kind("train.save_dir=/x: not writable; point it elsewhere"))) == 2
    err = capsys.readouterr().err
    assert err == "error: train.save_dir=/x: not writable; point it elsewhere\n"


def test_a_failing_file_system_is_one_line_naming_the_file_and_exit_1(capsys):
    full = OSError(errno.ENOSPC, "No space left on device", "/data/out/train/a.arrow")
    assert run_cli(_failing(full), on_os_error="free space and rerun") == 1
    assert capsys.readouterr().err == ("error: /data/out/train/a.arrow: No space left on "
                                       "device; free space and rerun\n")


def test_exit_codes_pass_through_and_other_errors_keep_their_traceback():
    assert run_cli(lambda argv: None) == 0
    assert run_cli(lambda argv: 1) == 1
    assert run_cli(lambda argv: len(argv), ["a", "b", "c"]) == 3
    with pytest.raises(KeyError):
        run_cli(_failing(KeyError("a bug")))


def test_a_run_error_is_one_line_and_exit_1(capsys):
    from megatron_rembert.errors import RunError
    from megatron_rembert.training.loop import TrainingError

    assert issubclass(TrainingError, RunError) and not issubclass(RunError, UserError)
    said = "rank 1 was at step 3, train step when a collective failed: a peer rank died"
    assert run_cli(_failing(TrainingError(said))) == 1
    assert capsys.readouterr().err == f"error: {said}\n"


# -- every write: fs.write_errors, one rule for whatever the writer raised ---------------------
TORCH_FULL_DISK = ("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed "
                   "writing file data/0: file write failed")


@pytest.mark.parametrize("raised", [RuntimeError(TORCH_FULL_DISK),
                                    OSError(errno.ENOSPC, "No space left on device")])
def test_any_failed_write_is_one_line_naming_the_file(raised, tmp_path, capsys):
    """torch's RuntimeError for a full disk and a file's OSError without a name, raised while
    an atomic write or a hashing file writes, end as one line naming the file; the temp file
    of the atomic write is gone and nothing was renamed into place."""
    from megatron_rembert.fs import HashingFile, WriteError, atomic_write

    def write(f):
        f.write(b"half")
        raise raised

    target = tmp_path / "out" / "manifest.json"
    with pytest.raises(WriteError) as caught:
        atomic_write(target, write)
    assert not target.exists() and list(target.parent.iterdir()) == []
    assert run_cli(_failing(caught.value)) == 1
    line = capsys.readouterr().err
    assert line.startswith(f"error: {target}: writing failed: ") and line.count("\n") == 1
    assert "GiB free there" in line and str(raised).splitlines()[0][-20:] in line

    class Full:
        name = "shard"

        def write(self, data):
            raise raised

    with pytest.raises(WriteError, match=r"^shard: writing failed"):
        HashingFile(file=Full()).write(b"x")


def test_a_bug_in_a_writer_keeps_its_traceback(tmp_path):
    from megatron_rembert.fs import atomic_write

    def write(f):
        raise TypeError("a bug: cannot pickle this")

    with pytest.raises(TypeError):
        atomic_write(tmp_path / "x.json", write)
    assert not list(tmp_path.iterdir())
