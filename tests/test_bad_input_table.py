"""A table of bad settings and bad files through train.py (--dry-run where the check happens
there), the data tools and the converter. Each must exit non-zero with exactly one `error:`
line naming the key, flag or file, no traceback, and write nothing where the run would have.

The entry points run in this process (their main() with captured output); a SystemExit
carrying a message is what Python would print to stderr with exit code 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rembert.convert.__main__ import main as convert_main
from megatron_rembert.prep import commands
from megatron_rembert.train import main as train_main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """Bad config files, a file where folders are expected, a one-file corpus."""
    root = tmp_path_factory.mktemp("bad_input")
    (root / "a_file").write_text("not a folder")
    (root / "syntax.yaml").write_text("train:\n  steps: [1\n")
    (root / "list.yaml").write_text("- train\n- optim\n")
    (root / "python.yaml").write_text("train: !!python/object/apply:os.system ['echo hi']\n")
    (root / "section.yaml").write_text("train: 5\n")
    (root / "latin1.yaml").write_bytes(b"train:\n  save_dir: caf\xe9\n")
    (root / "corpus" / "aa").mkdir(parents=True)
    (root / "corpus" / "aa" / "a.txt").write_text("one line of text\n")
    (root / "spm.model").write_bytes(b"\x00")
    return root


def _train(*sets, config=TINY):
    args = ["--config", config, "--dry-run"]
    for item in sets:
        args += ["--set", item]
    return ("train.py", args)


# (id, entry point, argv, what the error line must name, output that must not appear). In
# argv and in the last two fields, {d} is the fixture folder and {o} a fresh output folder.
CASES = [
    ("lr-nan", *_train("optim.lr=nan"), "optim.lr"),
    ("lr-inf", *_train("optim.lr=.inf"), "optim.lr"),
    ("lr-negative", *_train("optim.lr=-1e-4"), "optim.lr"),
    ("global-batch-0", *_train("train.global_batch_size=0"), "train.global_batch_size"),
    ("global-batch-negative", *_train("train.global_batch_size=-8"),
     "train.global_batch_size"),
    ("log-interval-0", *_train("train.log_interval=0"), "train.log_interval"),
    ("mask-prob-0", *_train("data.mask_prob=0"), "data.mask_prob"),
    ("mask-prob-1", *_train("data.mask_prob=1"), "data.mask_prob"),
    ("beta2-1", *_train("optim.beta2=1.0"), "optim.beta2"),
    ("timeout-inf", *_train("parallel.timeout_minutes=inf"), "parallel.timeout_minutes"),
    ("keep-last-0", *_train("train.keep_last=0"), "train.keep_last"),
    ("seed-negative", *_train("train.seed=-1"), "train.seed"),
    ("init-range-0", *_train("model.initializer_range=0"), "model.initializer_range"),
    ("predictions-over-seq", *_train("data.max_predictions=100", "data.seq_length=64"),
     "data.max_predictions"),
    ("min-lr-over-lr", *_train("optim.min_lr=1.0"), "optim.min_lr"),
    ("precision-not-a-choice", *_train("train.precision=fp64"), "train.precision"),
    ("tp-splits-heads", *_train("parallel.tp=4"), "parallel.tp=4"),
    ("save-dir-is-file", *_train("train.save_dir={d}/a_file"), "train.save_dir"),
    ("log-dir-is-file", *_train("train.log_dir={d}/a_file"), "train.log_dir"),
    ("save-dir-under-file", *_train("train.save_dir={d}/a_file/ckpt"), "train.save_dir"),
    # /proc/self takes no new files, whoever runs the test (root ignores chmod).
    ("save-dir-unwritable", *_train("train.save_dir=/proc/self/ckpt"), "train.save_dir"),
    ("yaml-syntax", *_train(config="{d}/syntax.yaml"), "syntax.yaml, line"),
    ("yaml-top-level-list", *_train(config="{d}/list.yaml"), "list.yaml"),
    ("yaml-python-tag", *_train(config="{d}/python.yaml"), "python.yaml, line 1"),
    ("yaml-section-not-mapping", *_train(config="{d}/section.yaml"), "section.yaml"),
    ("yaml-not-utf8", *_train(config="{d}/latin1.yaml"), "latin1.yaml"),
    ("config-missing", *_train(config="{d}/nope.yaml"), "nope.yaml"),
    ("world-size-0", "train.py", ["--config", TINY, "--dry-run", "--world-size", "0"],
     "--world-size"),
    ("preprocess-out-is-file", "preprocess.py", ["--corpus", "{d}/corpus", "--tokenizer",
     "{d}/spm.model", "--out", "{d}/a_file"], "--out"),
    ("preprocess-out-is-corpus", "preprocess.py", ["--corpus", "{d}/corpus", "--tokenizer",
     "{d}/spm.model", "--out", "{d}/corpus"], "--out"),
    ("preprocess-out-in-corpus", "preprocess.py", ["--corpus", "{d}/corpus", "--tokenizer",
     "{d}/spm.model", "--out", "{d}/corpus/data"], "--out"),
    ("preprocess-out-unwritable", "preprocess.py", ["--corpus", "{d}/corpus", "--tokenizer",
     "{d}/spm.model", "--out", "/proc/self/data"], "--out"),
    ("tokenizer-out-is-folder", "train_tokenizer.py", ["--corpus", "{d}/corpus", "--out",
     "{d}/corpus"], "--out"),
    ("tokenizer-out-under-file", "train_tokenizer.py", ["--corpus", "{d}/corpus", "--out",
     "{d}/a_file/spm"], "--out"),
    ("merge-out-is-file", "merge_datasets.py", ["{d}/corpus", "--out", "{d}/a_file"], "--out"),
    ("merge-out-in-part", "merge_datasets.py", ["{d}/corpus", "--out", "{d}/corpus/merged"],
     "--out"),
    ("demo-corpus-out-is-file", "make_demo_corpus.py", ["--out", "{d}/a_file"], "--out"),
    ("inspect-missing-dataset", "inspect_shards.py", ["{o}"], "{o}"),
    ("convert-missing-checkpoint", "convert", ["to-hf", "--checkpoint", "{d}/nope", "--out",
     "{o}"], "nope"),
    ("convert-checkpoint-is-file", "convert", ["reshard", "--checkpoint", "{d}/a_file",
     "--out", "{o}", "--tp", "1", "--pp", "1"], "a_file"),
    ("convert-missing-model", "convert", ["from-hf", "--model", "{d}/nope", "--out", "{o}"],
     "nope"),
]


def _main(tool: str):
    if tool == "convert":
        return convert_main
    if tool == "train.py":
        return train_main
    return getattr(commands, tool.removesuffix(".py"))  # data_tools/X.py runs commands.X


def _exit_code(main, argv) -> int:
    try:
        code = main(argv)
    except SystemExit as done:
        code = done.code
        if isinstance(code, str):  # what the interpreter does with sys.exit("message")
            print(code, file=sys.stderr)
            code = 1
    return code or 0


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b""
            for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_error_line(case, files, tmp_path, capsys):
    _, tool, argv, names = case
    out = tmp_path / "out"
    fill = {"d": str(files), "o": str(out)}
    before = _snapshot(files)
    code = _exit_code(_main(tool), [a.format(**fill) for a in argv])
    err = capsys.readouterr().err
    assert code not in (0, None), err
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert len(error_lines) == 1, err
    assert names.format(**fill) in error_lines[0], err
    assert "Traceback" not in err
    assert _snapshot(files) == before and not out.exists()  # nothing written


@pytest.mark.multiprocess
def test_train_py_refuses_bad_settings_before_deepspeed_starts(tmp_path):
    """A real process, without --dry-run: the error comes before torch.distributed and the
    model, and nothing is written."""
    run = subprocess.run(
        [sys.executable, "train.py", "--config", TINY, "--set", "optim.lr=nan",
         "--set", f"train.save_dir={tmp_path}/ckpt", "--set", f"train.log_dir={tmp_path}/logs"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip() == (
        "error: optim.lr=nan: must be a finite number > 0"), run.stderr
    assert not list(tmp_path.iterdir())
