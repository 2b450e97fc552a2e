"""Bad inputs give a clear error naming the file or flag, and write nothing."""

import json
import os
import shutil

import pytest
import torch

from megatron_rembert.convert.__main__ import main

pytest.importorskip("transformers")  # the hf_dir fixture (conftest.py)


def _fails(args, capsys, *expected):
    assert main(args) == 2
    err = capsys.readouterr().err
    for text in expected:
        assert text in err, err


def test_missing_files_and_incomplete_checkpoint(hf_dir, tmp_path, capsys):
    _fails(["to-hf", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
           capsys, "no such folder")
    step = tmp_path / "run" / "step_00000000"  # --out is outside its save folder
    shutil.copytree(hf_dir / "ckpt" / "step_00000000", step)
    os.remove(step / "complete")
    _fails(["to-hf", "--checkpoint", str(step), "--out", str(tmp_path / "o")], capsys,
           "no 'complete' marker")
    (step / "complete").write_text("")
    os.remove(step / "layer_01.safetensors")
    _fails(["to-hf", "--checkpoint", str(step), "--out", str(tmp_path / "o")], capsys,
           "layer_01.safetensors: no such file")
    assert not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".o.")]  # no debris
    hf = tmp_path / "hf"
    shutil.copytree(hf_dir / "hf", hf)
    os.remove(hf / "config.json")
    _fails(["from-hf", "--model", str(hf), "--out", str(tmp_path / "o")], capsys,
           "config.json")


def test_truncated_safetensors_and_mismatched_config(hf_dir, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(hf_dir / "hf", hf)
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[: len(data) // 2])
    _fails(["from-hf", "--model", str(hf), "--out", str(tmp_path / "o")], capsys,
           "model.safetensors", "truncated")
    assert not (tmp_path / "o").exists()
    (hf / "model.safetensors").write_bytes(data)
    _fails(["from-hf", "--model", str(hf), "--out", str(tmp_path / "o"), "--set",
            "model.preset=tiny"], capsys, "num_hidden_layers (2 vs 3)")
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "hidden_size": "wide"}))
    _fails(["from-hf", "--model", str(hf), "--out", str(tmp_path / "o")], capsys,
           "config.json: hidden_size='wide', expected int")
    (hf / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 7}))
    _fails(["from-hf", "--model", str(hf), "--out", str(tmp_path / "o")], capsys,
           "config.json: model.hidden_size", "num_attention_heads=7")
    cfg["vocab_size"] = 301
    (hf / "config.json").write_text(json.dumps(cfg))
    _fails(["from-hf", "--model", str(hf), "--out", str(tmp_path / "o")], capsys,
           "word_embeddings", "shape")
    assert not (tmp_path / "o").exists()


def test_non_empty_output_needs_force_and_wrong_tokenizer(hf_dir, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    step = str(hf_dir / "ckpt" / "step_00000000")
    _fails(["to-hf", "--checkpoint", step, "--out", str(out)], capsys, "not empty", "--force")
    assert (out / "keep.txt").exists()
    bogus = tmp_path / "spm.model"
    bogus.write_bytes(b"not a model")
    _fails(["to-hf", "--checkpoint", step, "--out", str(tmp_path / "o2"), "--tokenizer",
            str(bogus)], capsys, "spm.model")
    assert main(["to-hf", "--checkpoint", step, "--out", str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    _fails(["reshard", "--checkpoint", step, "--out", str(tmp_path / "r"), "--tp", "4",
            "--pp", "1"], capsys, "--tp 4")


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_with_code_is_refused_not_run(hf_dir, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(hf_dir / "hf", hf)
    from safetensors.torch import load_file

    state = load_file(hf / "model.safetensors")
    os.remove(hf / "model.safetensors")
    marker = tmp_path / "pwned"
    torch.save({**state, "payload": _Evil(str(marker))}, hf / "pytorch_model.bin")
    _fails(["from-hf", "--model", str(hf), "--out", str(tmp_path / "o")], capsys,
           "pytorch_model.bin", "refused")
    assert not marker.exists()
    assert not (tmp_path / "o").exists()
