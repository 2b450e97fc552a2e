"""train.py with one failure of the machine injected, for tests/training/test_failure_table.py:
`python tests/training/failing_train.py --config ... [--set ...]` with FAILURE=<name> and
FAILING_RANK=<rank> in the environment (read here only, never by the package).

- checkpoint-disk-full: every `torch.save` into a step folder raises what torch raises when the
  disk is full (a RuntimeError from its stream writer, not an OSError);
- optimizer-shard-disk-full: the rank's optimizer shard file (our safetensors writer, on every
  path) takes its first tensor, then the next write fails with ENOSPC;
- metrics-disk-full: metrics.jsonl takes its first row, then every write fails with ENOSPC (a
  Python file's OSError, which names no file).
A real full disk is not available to a test (no tiny file system to mount), so the exception
is raised where the file system would raise it: below the package's own code. With
FAILING_SAVE=<step folder name> set, the checkpoint failures hit only that step's save (the
disk fills up later in the run: the earlier checkpoints are good).
"""

from __future__ import annotations

import errno
import os


def _full(path) -> bool:
    """Whether a write to `path` (in a step folder) finds the disk full."""
    return (os.environ.get("FAILING_SAVE") or "step_") in str(path)


def _saving(save_dir) -> bool:
    """Whether a write into the save folder (DeepSpeed copies its scripts there, not into the
    step folder) comes while FAILING_SAVE's step folder is written (always, unset)."""
    step = os.environ.get("FAILING_SAVE")
    return not step or os.path.isdir(os.path.join(save_dir, step))


def _checkpoint_disk_full() -> None:
    import torch

    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and _full(f):
            raise RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter "
                               "failed writing file data/0: file write failed")
        return real_save(obj, f, *args, **kwargs)

    torch.save = save


class _FillingFile:
    """A text file whose writes fail with ENOSPC after the first."""

    def __init__(self, file):
        self._file, self._writes = file, 0
        self.name = file.name

    def write(self, text: str) -> int:
        self._writes += 1
        if self._writes > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._file.write(text)

    def __getattr__(self, name):
        return getattr(self._file, name)


def _metrics_disk_full() -> None:
    from megatron_rembert.training import metrics

    metrics.open = lambda *args, **kwargs: _FillingFile(open(*args, **kwargs))  # noqa: SIM115


def _optimizer_shard_disk_full() -> None:
    from megatron_rembert.checkpoint import optimizer_shards

    class Filling(optimizer_shards.SafetensorsWriter):
        def __init__(self, path, *args, **kwargs):
            super().__init__(path, *args, **kwargs)
            self.fills = _full(path)
            self.written = 0

        def write(self, name, tensor):
            if self.fills and self.written:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.written += 1
            return super().write(name, tensor)

    optimizer_shards.SafetensorsWriter = Filling


FAILURES = {"checkpoint-disk-full": _checkpoint_disk_full,
            "optimizer-shard-disk-full": _optimizer_shard_disk_full,
            "metrics-disk-full": _metrics_disk_full}

if __name__ == "__main__":
    if os.environ.get("FAILING_RANK", "0") == os.environ.get("RANK", "0"):
        FAILURES[os.environ["FAILURE"]]()
    from megatron_rembert.train import console_main

    console_main()  # as rembert-train ends
