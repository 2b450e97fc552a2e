"""Inputs that are not what they seem (issue "Nothing ends done that did not train", class D),
through train.py, the data tools and the converter as tests/test_bad_input_table.py runs them:
each ends in exactly one `error:` line naming the input, no traceback, nothing written.

- YAML that expands without bound: an alias (`*name`) repeats an anchored node by reference,
  so a few lines stand for billions of values ("billion laughs"); the type check or the error
  message that walks them used to end in a MemoryError (the
  variants other than `yaml-billion-laughs` are kept to 9^5 values: enough to show the
  old huge line without taking the memory). Aliases are refused where the YAML is
  read, naming the file and line or the --set key.
- Names that are not valid UTF-8 (a folder with the byte 0xff, as Python hands it on: a lone
  surrogate): pyarrow, sentencepiece and TensorBoard encode paths as UTF-8 and used to end in
  a UnicodeEncodeError or TypeError traceback. Every entry point refuses such an argument
  (cli.run_cli), naming the flag.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.test_bad_input_table import TINY, _exit_code, _main, _snapshot


def _laughs(depth: int = 5) -> str:
    """A flow list of 9^depth leaves written with `depth` anchors and aliases."""
    text = "[&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"
    for i in range(1, depth):
        text += f", &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]"
    return text + f", *a{depth - 1}]"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("odd_inputs")
    (root / "laughs_str_key.yaml").write_text(f"train:\n  save_dir: {_laughs()}\n")
    (root / "billion_laughs.yaml").write_text(f"train:\n  save_dir: {_laughs(9)}\n")
    (root / "laughs_section.yaml").write_text(f"train:\n  steps: 2\njunk: {_laughs()}\n")
    (root / "merge_key.yaml").write_text(
        "base: &base {steps: 2}\ntrain:\n  <<: *base\n  log_interval: 1\n")
    bad = root / os.fsdecode(b"\xffbad")  # what Python makes of such a name
    (bad / "corpus" / "aa").mkdir(parents=True)
    (bad / "corpus" / "aa" / "a.txt").write_text("one line of text\n")
    (bad / "spm.model").write_bytes(b"\x00")
    (root / "corpus" / "aa").mkdir(parents=True)
    (root / "corpus" / "aa" / "a.txt").write_text("one line of text\n")
    (root / "spm.model").write_bytes(b"\x00")
    return root


def _train(*sets, config=TINY):
    args = ["--config", config, "--dry-run"]
    for item in sets:
        args += ["--set", item]
    return ("train.py", args)


BAD = os.fsdecode(b"\xffbad")
# (id, entry point, argv, what the error line must name); {d}: the fixture folder, {o}: a
# fresh output folder, {b}: the fixture's folder whose name has the byte 0xff.
CASES = [
    ("yaml-laughs-str-key", *_train(config="{d}/laughs_str_key.yaml"),
     "laughs_str_key.yaml, line 2"),
    ("yaml-billion-laughs", *_train(config="{d}/billion_laughs.yaml"),  # 9^9 values
     "billion_laughs.yaml, line 2"),
    ("yaml-laughs-section", *_train(config="{d}/laughs_section.yaml"),
     "laughs_section.yaml, line 3"),
    ("yaml-merge-key", *_train(config="{d}/merge_key.yaml"), "merge_key.yaml, line 3"),
    ("set-laughs-list", *_train(f"data.phase_starts={_laughs()}"), "--set data.phase_starts"),
    ("set-laughs-int", *_train(f"train.steps={_laughs(3)}"), "--set train.steps"),
    ("utf8-train-log-dir", *_train("train.log_dir={b}/logs"), r"train.log_dir={d}/\xffbad"),
    ("utf8-train-data-path", *_train("data.path={b}/data"), r"data.path={d}/\xffbad/data"),
    ("utf8-preprocess-tokenizer", "preprocess.py", [
        "--corpus", "{d}/corpus", "--tokenizer", "{b}/spm.model", "--out", "{o}"],
     r"--tokenizer {d}/\xffbad/spm.model"),
    ("utf8-preprocess-corpus", "preprocess.py", [
        "--corpus", "{b}/corpus", "--tokenizer", "{d}/spm.model", "--out", "{o}"],
     r"--corpus {d}/\xffbad/corpus"),
    ("utf8-tokenizer-out", "train_tokenizer.py", [
        "--corpus", "{d}/corpus", "--out", "{b}/tok/spm"], r"--out {d}/\xffbad/tok/spm"),
    ("utf8-convert-checkpoint", "convert", [
        "to-hf", "--checkpoint", "{b}/ckpt", "--out", "{o}"],
     r"--checkpoint {d}/\xffbad/ckpt"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_odd_input_is_one_error_line(case, inputs, tmp_path, capsys):
    _, tool, argv, names = case
    if "{b}/ckpt" in argv:  # a real checkpoint (from-hf of a small model) in the odd folder
        _checkpoint(inputs / BAD / "ckpt")
    out = tmp_path / "out"
    fill = {"d": str(inputs), "o": str(out), "b": str(inputs / BAD)}
    before = _snapshot(inputs)
    code = _exit_code(_main(tool), [a.format(**fill) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and "Traceback" not in err, err[-2000:]
    assert names.format(**fill) in error_lines[0], error_lines[0][:2000]
    assert len(error_lines[0]) < 500, error_lines[0][:2000]  # no expanded value in it
    assert _snapshot(inputs) == before and not out.exists()


def _checkpoint(folder: Path) -> None:
    if folder.exists():
        return
    from megatron_rembert.convert.__main__ import main
    from tests.convert.tampering import save_hf_model

    build = folder.parent.parent / "build"  # a name the converter takes
    model = save_hf_model(build / "model")
    assert main(["from-hf", "--model", str(model), "--out", str(build / "ckpt")]) == 0
    shutil.move(build / "ckpt", folder)
    shutil.rmtree(build)
