"""The converter's command line: help texts, save folders as --checkpoint, reshard's defaults,
and output folders that follow the user's umask."""

import json
import os
import stat

import pytest

from megatron_rembert.convert.__main__ import build_parser, main

pytest.importorskip("transformers")  # the hf_dir fixture (conftest.py)

REQUIRED = {"to-hf": ["--checkpoint", "--out"], "export-encoder": ["--checkpoint", "--out"],
            "from-hf": ["--model", "--out"], "reshard": ["--checkpoint", "--out"]}


def test_every_help_renders_whole_sentences_and_names_required_flags():
    parser = build_parser()
    top = parser.format_help()
    assert "docs/convert.md" in top and not top.rstrip().endswith("...")
    commands = parser._subparsers._group_actions[0].choices
    for name, flags in REQUIRED.items():
        text = commands[name].format_help()
        assert text.rstrip().endswith("--out"), text  # the last help line is --force's
        for flag in flags:
            assert flag in commands[name].format_usage().split(), (name, flag)
            action = next(a for a in commands[name]._actions if flag in a.option_strings)
            assert action.required and action.help, (name, flag)
        assert all(a.help for a in commands[name]._actions), name


def _layout(save_dir):
    return json.loads((save_dir / "step_00000000" / "meta.json").read_text())["layout"]


def test_save_folder_follows_latest_umask_and_reshard_keeps_layout(hf_dir, tmp_path, capsys):
    old = os.umask(0o022)
    try:
        assert main(["to-hf", "--checkpoint", str(hf_dir / "ckpt"),
                     "--out", str(tmp_path / "hf")]) == 0
        assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o755
        assert main(["reshard", "--checkpoint", str(hf_dir / "ckpt"), "--out",
                     str(tmp_path / "pp3"), "--pp", "3"]) == 0
        assert stat.S_IMODE((tmp_path / "pp3").stat().st_mode) == 0o755
    finally:
        os.umask(old)
    assert (tmp_path / "hf" / "model.safetensors").exists()
    assert (_layout(tmp_path / "pp3")["tp"], _layout(tmp_path / "pp3")["pp"]) == (1, 3)
    assert main(["reshard", "--checkpoint", str(tmp_path / "pp3"), "--out",
                 str(tmp_path / "tp2"), "--tp", "2"]) == 0  # pp stays 3
    assert (_layout(tmp_path / "tp2")["tp"], _layout(tmp_path / "tp2")["pp"]) == (2, 3)
    assert "for tp=2 pp=3" in capsys.readouterr().out
    (tmp_path / "tp2" / "latest").unlink()
    assert main(["to-hf", "--checkpoint", str(tmp_path / "tp2"), "--out",
                 str(tmp_path / "o")]) == 2
    assert "without 'latest'" in capsys.readouterr().err
