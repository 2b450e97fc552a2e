"""The portable checkpoint: full tensors per pipeline layer, loadable at any TP x PP x DP.

Written by `convert from-hf` (weights only) and `convert reshard` (weights + optimizer state),
read by the trainer (training/full_tensors.py puts the tensors into the engine) and by the
converters, when `meta.json` says `"format": "megatron-rembert-portable-v1"`:

    step_XXXXXXXX/
        layer_00.safetensors   embeddings; layer_{i+1}: Transformer layer i; layer_{L+1}: head
                               tensors: NAME (fp32 master weight, or the weight as given),
                               exp_avg/NAME, exp_avg_sq/NAME (absent when weights only)
        index.json             tensor name -> file
        meta.json              config, layout (the one asked for), step, consumed_samples,
                               format, weights_only, optimizer {steps, lr_scheduler, ...}
        manifest.json          size and sha256 of every file (step_folder.py)
        complete

Tensors are stored full (not TP-split) with the vocabulary padding stripped; each rank reads
only its slice (`safe_open(...).get_slice`, see specs.shard).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch

from megatron_rembert.checkpoint import CheckpointError
from megatron_rembert.checkpoint.files import ST_DTYPES, SafetensorsWriter, safe_open_checked
from megatron_rembert.checkpoint.specs import ParamSpec, shard
from megatron_rembert.checkpoint.step_folder import commit, step_tag

PORTABLE_FORMAT = "megatron-rembert-portable-v1"
OPTIM_KEYS = ("exp_avg", "exp_avg_sq")
INDEX = "index.json"


def is_portable(meta: dict) -> bool:
    return str(meta.get("format", "")).startswith("megatron-rembert-portable")


def write_portable(save_dir: Path, specs: list[ParamSpec], step: int, meta: dict,
                   weight: Callable[[ParamSpec], torch.Tensor],
                   optim_state: Callable[[ParamSpec, str], torch.Tensor] | None,
                   dtypes: dict[str, torch.dtype]) -> Path:
    """Write `save_dir/step_XXXXXXXX/` plus `save_dir/latest`, one tensor in memory at a time.

    weight(spec): the full weight (vocabulary stripped); optim_state(spec, key) likewise for
    'exp_avg' / 'exp_avg_sq', or None for weights only. dtypes: the weight dtype per name.
    """
    folder = save_dir / step_tag(step)
    folder.mkdir(parents=True)
    index: dict[str, str] = {}
    records: dict[str, dict] = {}
    for layer in sorted({s.layer for s in specs}):
        file = f"layer_{layer:02d}.safetensors"
        mine = [s for s in specs if s.layer == layer]
        entries = [(s.name, dtypes[s.name], s.shape) for s in mine]
        if optim_state is not None:
            entries += [(f"{k}/{s.name}", torch.float32, s.shape) for s in mine
                        for k in OPTIM_KEYS]
        with SafetensorsWriter(folder / file, entries) as writer:
            for s in mine:
                writer.write(s.name, weight(s).to(dtypes[s.name]))
            if optim_state is not None:
                for s in mine:
                    for k in OPTIM_KEYS:
                        writer.write(f"{k}/{s.name}", optim_state(s, k).float())
        records[file] = writer.record()
        index.update({name: file for name, _, _ in entries})
    (folder / INDEX).write_text(json.dumps(index, indent=1))
    meta = {**meta, "format": PORTABLE_FORMAT, "step": step,
            "weights_only": optim_state is None}
    commit(save_dir, folder, meta, records)
    return folder


class PortableReader:
    """Tensors of a portable step folder by name: full, or one TP rank's shard.

    Use as a context manager; files stay open (memory-mapped) until it exits.
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        path = self.folder / INDEX
        try:
            self.index: dict[str, str] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path}: unreadable ({err})") from err
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}

    def _file(self, key: str):
        if key not in self.index:
            raise CheckpointError(f"{self.folder / INDEX}: no tensor {key}")
        file = self.index[key]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open_checked(self.folder / file))
        return self._handles[file]

    def full(self, key: str) -> torch.Tensor:
        return self._file(key).get_tensor(key)

    def dtype(self, key: str) -> torch.dtype:
        name = self._file(key).get_slice(key).get_dtype()
        return next(dt for dt, st in ST_DTYPES.items() if st == name)

    def local_shard(self, key: str, spec: ParamSpec, tp: int, tp_rank: int) -> torch.Tensor:
        """This TP rank's slice of the stored full tensor `key`, shaped like `spec`'s shard."""
        sliced = self._file(key).get_slice(key)
        stored = tuple(sliced.get_shape())
        if stored != spec.shape:
            raise CheckpointError(f"{self.folder / self.index[key]}: {key} has shape {stored}, "
                                  f"the model expects {spec.shape}")
        return shard(sliced, spec, tp, tp_rank)

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> PortableReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
