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
