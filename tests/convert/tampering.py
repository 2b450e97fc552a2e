"""Inputs a converter must refuse, built by editing good ones: a transformers folder whose
tensors or config.json were changed, a portable checkpoint whose files were changed and whose
manifest was rewritten to match (so only the tensor check can catch them)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_rembert.checkpoint.step_folder import write_manifest
from megatron_rembert.convert.hf import hf_config_dict
from tests.model.helpers import small_config

Tensors = dict[str, torch.Tensor]


def save_hf_model(folder: Path, seed: int = 0) -> Path:
    """A small transformers RemBertForMaskedLM (3 layers, vocab 300) saved in `folder`."""
    import transformers

    torch.manual_seed(seed)
    transformers.RemBertForMaskedLM(
        transformers.RemBertConfig(**hf_config_dict(small_config()))).save_pretrained(folder)
    return folder


def edit_safetensors(path: Path, edit: Callable[[Tensors], object]) -> None:
    """Rewrite a safetensors file after `edit` changed its tensors in place."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def copy_hf(source: Path, folder: Path, edit: Callable[[Tensors], object] | None = None,
            config: dict | None = None) -> Path:
    """A copy of a transformers folder, its tensors edited and config.json keys replaced."""
    shutil.copytree(source, folder)
    if edit is not None:
        edit_safetensors(folder / "model.safetensors", edit)
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **config}))
    return folder


def copy_checkpoint(save_dir: Path, out: Path, file: str | None = None,
                    edit: Callable[[Tensors], object] | None = None,
                    model: dict | None = None) -> Path:
    """A copy of a portable save folder (step_00000000 and latest) with `file` of its step
    folder edited and/or meta.json's model fields replaced; the manifest rewritten."""
    shutil.copytree(save_dir, out)
    step = out / "step_00000000"
    if edit is not None:
        edit_safetensors(step / file, edit)
    if model:
        meta = json.loads((step / "meta.json").read_text())
        meta["config"]["model"].update(model)
        (step / "meta.json").write_text(json.dumps(meta))
    write_manifest(step, {})
    return out


def set_dtype(name: str, dtype: torch.dtype) -> Callable[[Tensors], None]:
    def edit(tensors: Tensors) -> None:
        tensors[name] = tensors[name].to(dtype)
    return edit


def reshape(name: str) -> Callable[[Tensors], None]:
    """The tensor with its first dimension one shorter."""
    def edit(tensors: Tensors) -> None:
        tensors[name] = tensors[name][:-1].contiguous()
    return edit


def drop(name: str) -> Callable[[Tensors], None]:
    def edit(tensors: Tensors) -> None:
        del tensors[name]
    return edit


def add_copy(name: str, new: str) -> Callable[[Tensors], None]:
    def edit(tensors: Tensors) -> None:
        tensors[new] = tensors[name].clone()
    return edit


def copy_step(step: Path, out: Path, file: str | None = None,
              edit: Callable[[Tensors], object] | None = None, model: dict | None = None) -> Path:
    """A copy of one of the trainer's step folders (into `out`, a new save folder) with the
    tensors of optimizer shard `file` edited and/or meta.json's model fields replaced; the
    manifest rewritten."""
    folder = out / step.name
    shutil.copytree(step, folder)
    if edit is not None:
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(folder / file, "pt") as handle:
            metadata = handle.metadata()
            data = {k: handle.get_tensor(k) for k in handle.keys()}
        edit(data)
        save_file(data, folder / file, metadata=metadata)
    if model:
        meta = json.loads((folder / "meta.json").read_text())
        meta["config"]["model"].update(model)
        (folder / "meta.json").write_text(json.dumps(meta))
    write_manifest(folder, {})
    return folder
