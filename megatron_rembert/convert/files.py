"""File plumbing for conversion: safe reads, a streaming safetensors writer, atomic outputs.

- Outside weights are read only with safetensors or `torch.load(weights_only=True)`: a pickle
  that carries code is refused, never run.
- `SafetensorsWriter` writes one tensor at a time (the header is computed up front from names,
  dtypes and shapes), so a converter holds one tensor in memory, not the whole model.
- `staged_output` writes into a hidden folder next to the output and renames it at the end:
  an error or a kill leaves no half-written output.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


class ConvertError(RuntimeError):
    """Bad input or output for a conversion; the message names the file or flag."""


# safetensors dtype names (the format's own spelling).
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}


class SafetensorsWriter:
    """Streams tensors into one .safetensors file in a fixed order.

    `entries`: (name, dtype, shape) of every tensor, in the order they will be written.
    """

    def __init__(self, path: str | Path, entries: list[tuple[str, torch.dtype, tuple]],
                 metadata: dict[str, str] | None = None):
        header: dict = {"__metadata__": metadata} if metadata else {}
        offset = 0
        self._expected: list[tuple[str, torch.dtype, tuple]] = []
        for name, dtype, shape in entries:
            if dtype not in _ST_DTYPES:
                raise ConvertError(f"{path}: cannot write {name} of dtype {dtype}")
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
            self._expected.append((name, dtype, tuple(shape)))
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes
        self.path = Path(path)
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        exp_name, dtype, shape = self._expected[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (exp_name, dtype, shape):
            raise ConvertError(f"{self.path}: expected {exp_name} {dtype} {shape}, got {name} "
                               f"{tensor.dtype} {tuple(tensor.shape)}")
        data = tensor.detach().contiguous().cpu()
        self._file.write(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        self._next += 1

    def close(self) -> None:
        missing = [n for n, _, _ in self._expected[self._next:]]
        self._file.close()
        if missing:
            raise ConvertError(f"{self.path}: {len(missing)} tensors never written, e.g. "
                               f"{missing[:3]}")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


def torch_load_weights(path: str | Path, mmap: bool = True, allowed: tuple = ()) -> object:
    """`torch.load(weights_only=True)`, memory-mapped; refuses pickles that carry code.

    `allowed`: extra classes trusted by name (DeepSpeed's own checkpoint bookkeeping).
    """
    path = Path(path)
    if not path.is_file():
        raise ConvertError(f"{path}: no such file")
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise ConvertError(
            f"{path}: refused to load: the pickle holds objects other than tensors and plain "
            f"data (weights_only=True): {str(err).splitlines()[0]}. Only load files you trust; "
            "convert them to safetensors first") from err
    except (RuntimeError, EOFError, OSError) as err:
        if mmap and "mmap" in str(err):  # legacy (non-zip) files cannot be memory-mapped
            return torch_load_weights(path, mmap=False, allowed=allowed)
        raise ConvertError(f"{path}: unreadable ({err}); it may be truncated") from err


@contextmanager
def staged_output(out: str | Path, force: bool) -> Iterator[Path]:
    """Yield a temporary folder next to `out`; on success it replaces `out`.

    `out` must not exist or be an empty folder, unless `force` (then it is replaced).
    """
    out = Path(out)
    if out.exists():
        if not out.is_dir():
            raise ConvertError(f"--out {out}: exists and is not a folder")
        if any(out.iterdir()) and not force:
            raise ConvertError(f"--out {out}: folder is not empty; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
