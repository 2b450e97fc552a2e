"""File access for checkpoints: sha256 while writing, safe reads.

- `megatron_rembert.fs` (the ground floor every package uses) has `atomic_write` and
  `HashingFile`, which hashes every byte written through it, so a checkpoint's manifest costs
  no second read of what we write.
- `SafetensorsWriter` streams one tensor at a time (the header is computed up front).
- Reading is only ever safetensors or `torch.load(weights_only=True)`: a pickle that carries
  code is refused, never run.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_rembert.checkpoint import CheckpointError
from megatron_rembert.fs import HashingFile

# The first bytes of torch.save's default (zip) format, which torch.load checks the same way;
# files of the legacy format (`_use_new_zipfile_serialization=False`) cannot be memory-mapped.
ZIP_MAGIC = b"PK\x03\x04"

# The dtypes the settings and meta.json name (train.precision, parallel.grad_reduce_dtype).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# safetensors dtype names (the format's own spelling).
ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}
_ST_NAMES = {st: str(dt).removeprefix("torch.") for dt, st in ST_DTYPES.items()}


@dataclass(frozen=True)
class StoredTensor:
    """What a file says of one tensor, read without its data (a safetensors header, a
    memory-mapped pickle): the file, the name it is stored under, its shape and dtype in torch's
    spelling (`float32`, `int8`; safetensors' own for types torch lacks; `not a tensor (T)` for
    other pickled values), so a converter can check a file before converting any of it."""

    file: Path
    name: str
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, file: Path, name: str, value: Any) -> StoredTensor:
        if not isinstance(value, torch.Tensor):
            return cls(file, name, (), f"not a tensor ({type(value).__name__})")
        return cls(file, name, tuple(value.shape), str(value.dtype).removeprefix("torch."))


def safetensors_entries(handle: Any, file: Path) -> list[StoredTensor]:
    """Every tensor of an open safetensors file, from its header."""
    out = []
    for name in handle.keys():
        sliced = handle.get_slice(name)
        out.append(StoredTensor(file, name, tuple(sliced.get_shape()),
                                _ST_NAMES.get(sliced.get_dtype(), sliced.get_dtype())))
    return out


class SafetensorsWriter:
    """Streams tensors into one .safetensors file in a fixed order, hashing as it writes.

    `entries`: (name, dtype, shape) of every tensor, in the order they will be written.
    """

    def __init__(self, path: str | Path, entries: list[tuple[str, torch.dtype, tuple]],
                 metadata: dict[str, str] | None = None):
        header: dict = {"__metadata__": metadata} if metadata else {}
        offset = 0
        self._expected: list[tuple[str, torch.dtype, tuple]] = []
        for name, dtype, shape in entries:
            if dtype not in ST_DTYPES:
                raise CheckpointError(f"{path}: cannot write {name} of dtype {dtype}")
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
            self._expected.append((name, dtype, tuple(shape)))
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes
        self.path = Path(path)
        self._file = HashingFile(self.path)
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next == len(self._expected):
            raise CheckpointError(f"{self.path}: {name} is one tensor more than the header")
        exp_name, dtype, shape = self._expected[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (exp_name, dtype, shape):
            raise CheckpointError(f"{self.path}: expected {exp_name} {dtype} {shape}, got "
                                  f"{name} {tensor.dtype} {tuple(tensor.shape)}")
        data = tensor.detach().contiguous().cpu()
        if data.numel():
            self._file.write(data.view(torch.uint8).numpy())
        self._next += 1

    def record(self) -> dict:
        return self._file.record()

    def close(self) -> None:
        missing = [n for n, _, _ in self._expected[self._next:]]
        self._file.close()
        if missing:
            raise CheckpointError(f"{self.path}: {len(missing)} tensors never written, e.g. "
                                  f"{missing[:3]}")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


@contextmanager
def safe_open_checked(path: str | Path) -> Iterator[Any]:
    """`safetensors.safe_open` that names the file when it is missing, truncated or corrupt."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as err:  # noqa: BLE001 - safetensors raises several error types
        raise CheckpointError(f"{path}: not a valid safetensors file ({err}); it may be "
                              "truncated: copy it again") from err
    _check_safetensors_size(path)
    with handle as f:
        yield f


def _check_safetensors_size(path: Path) -> None:
    """safe_open maps the file lazily; check up front that every tensor's bytes are there."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
              default=0)
    if path.stat().st_size < 8 + n + end:
        raise CheckpointError(f"{path}: truncated ({path.stat().st_size} bytes, the header "
                              f"promises {8 + n + end}); copy it again")


def torch_load_weights(path: str | Path, mmap: bool = True, map_location: Any = "cpu") -> Any:
    """`torch.load(weights_only=True)`, memory-mapped unless the file is of the legacy
    (non-zip) format; refuses pickles that carry code.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        if mmap:
            with open(path, "rb") as f:
                mmap = f.read(len(ZIP_MAGIC)) == ZIP_MAGIC
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        what = f" ({found.group(1)})" if found else ""
        raise CheckpointError(
            f"{path}: refused to load: the pickle holds objects other than tensors and plain "
            f"data{what}, which could run code. Only load files you trust") from err
    except (RuntimeError, EOFError, OSError) as err:
        raise CheckpointError(f"{path}: unreadable ({err}); it may be truncated") from err
