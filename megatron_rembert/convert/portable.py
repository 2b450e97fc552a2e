"""The portable checkpoint: full tensors per pipeline layer, loadable at any TP x PP x DP.

Written by `from-hf` (weights only) and `reshard` (weights + optimizer state), read by the
trainer when `meta.json` says `"format": "megatron-rembert-portable-v1"`:

    step_XXXXXXXX/
        layer_00.safetensors   embeddings; layer_{i+1}: Transformer layer i; layer_{L+1}: head
                               tensors: NAME (fp32 master weight, or the weight as given),
                               exp_avg/NAME, exp_avg_sq/NAME (absent when weights only)
        index.json             tensor name -> file
        meta.json              config, layout (the one asked for), step, consumed_samples,
                               format, weights_only, optimizer {steps, lr_scheduler, ...}
        complete

Tensors are stored full (not TP-split) with the vocabulary padding stripped; each rank reads
only its slice (`safe_open(...).get_slice`) and zero-fills its padding rows, which is exact:
padded rows have zero weight, gradient and Adam moments in training.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_rembert.convert.checkpoint_io import ParamSpec
from megatron_rembert.convert.files import SafetensorsWriter
from megatron_rembert.training.checkpoint import COMPLETE, LATEST, step_tag
from megatron_rembert.training.portable import OPTIM_KEYS, PORTABLE_FORMAT


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
    layers = sorted({s.layer for s in specs})
    for layer in layers:
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
        index.update({name: file for name, _, _ in entries})
    (folder / "index.json").write_text(json.dumps(index, indent=1))
    meta = {**meta, "format": PORTABLE_FORMAT, "step": step,
            "weights_only": optim_state is None}
    (folder / "meta.json").write_text(json.dumps(meta, indent=2))
    (folder / COMPLETE).write_text("")
    (save_dir / LATEST).write_text(step_tag(step) + "\n")
    return folder
