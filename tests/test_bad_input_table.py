"""A table of bad settings and bad files through train.py (--dry-run where the check happens
there), the data tools and the converter. Each must exit non-zero with exactly one `error:`
line naming the key, flag or file, no traceback, and write nothing where the run would have.

The entry points run in this process (their main() with captured output); a SystemExit
carrying a message is what Python would print to stderr with exit code 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

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
    _outside_their_folder(root)
    _edited_meta_checkpoint(root / "edited_meta")
    _edited_meta_checkpoint(root / "edited_meta_too")
    return root


def _outside_their_folder(root: Path) -> None:
    """Issue 30: datasets and save folders whose files name paths outside their folder, and
    what those paths reach (`victim/`, `other_run/`), which must stay untouched."""
    from megatron_rembert.data.shards import SCHEMA_VERSION, write_shard
    from megatron_rembert.fs import sha256_file

    rows = np.full((2, 8), 7, np.int32)
    rows[:, 0] = 2  # [CLS]
    victim = root / "victim"
    shard = write_shard(victim / "aa-train-00000.arrow", rows, "aa", pad_id=0)
    np.save(victim / "word_starts.npy", np.zeros(16, bool))

    def dataset(name: str, shard_file: str, word_starts: str = "word_starts.npy") -> Path:
        folder = root / name
        folder.mkdir()
        np.save(folder / "word_starts.npy", np.zeros(16, bool))
        manifest = {
            "schema_version": SCHEMA_VERSION, "seq_length": 8, "valid_fraction": 0.0,
            "tokenizer": {"sha256": "0" * 64, "vocab_size": 16, "model_file": "spm.model"},
            "special_ids": {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4},
            "word_starts": {"file": word_starts, "sha256": sha256_file(victim / "word_starts.npy")},
            "shards": [{"file": shard_file, "split": "train", **shard}],
            "languages": {"aa": {"documents": 1, "train_rows": 2, "valid_rows": 0,
                                 "train_tokens": shard["tokens"], "valid_tokens": 0}},
            "skipped": {}}
        (folder / "manifest.json").write_text(json.dumps(manifest))
        return folder

    dataset("ds_dotdot", "../victim/aa-train-00000.arrow")
    dataset("ds_absolute", str(victim / "aa-train-00000.arrow"))
    linked = dataset("ds_symlink", "train/aa/aa-train-00000.arrow")
    (linked / "train" / "aa").mkdir(parents=True)
    os.symlink(victim / "aa-train-00000.arrow", linked / "train" / "aa" / "aa-train-00000.arrow")
    inside = dataset("ds_ws_dotdot", "train/aa/aa-train-00000.arrow", "../victim/word_starts.npy")
    write_shard(inside / "train" / "aa" / "aa-train-00000.arrow", rows, "aa", pad_id=0)

    from megatron_rembert.checkpoint.step_folder import commit

    meta = {"config": {"model": {"preset": "tiny", "vocab_size": 1000}},
            "layout": {"tp": 1, "pp": 1, "dp": 1}, "step": 2, "consumed_samples": 64}
    other = root / "other_run" / "step_00000002"
    other.mkdir(parents=True)
    (other / "weights.bin").write_bytes(b"another run's weights")
    commit(root / "other_run", other, meta, {})
    (root / "run_latest_abs").mkdir()
    (root / "run_latest_abs" / "latest").write_text(f"{other}\n")
    (root / "run_latest_dotdot").mkdir()
    (root / "run_latest_dotdot" / "latest").write_text("../other_run/step_00000002\n")
    (root / "run_step_link").mkdir()
    os.symlink(other, root / "run_step_link" / "step_00000002")
    (root / "run_step_link" / "latest").write_text("step_00000002\n")
    # A step folder of this run whose manifest.json vouches for a file of the other run.
    mine = root / "run_manifest_out" / "step_00000002"
    mine.mkdir(parents=True)
    commit(mine.parent, mine, meta, {})
    listed = json.loads((mine / "manifest.json").read_text())
    listed["files"]["../../other_run/step_00000002/weights.bin"] = {
        "size": len(b"another run's weights"), "sha256": sha256_file(other / "weights.bin")}
    (mine / "manifest.json").write_text(json.dumps(listed))


def _edited_meta_checkpoint(save_dir: Path) -> None:
    """A committed step folder whose meta.json was edited by hand afterwards (its model no
    longer a mapping, which every reader of the values would trip over)."""
    import json

    from megatron_rembert.checkpoint.step_folder import commit

    folder = save_dir / "step_00000001"
    folder.mkdir(parents=True)
    meta = {"config": {"model": {"preset": "tiny"}}, "layout": {"dp": 1, "tp": 1, "pp": 1},
            "step": 1, "consumed_samples": 8}
    commit(save_dir, folder, meta, {})
    (folder / "meta.json").write_text(json.dumps({**meta, "config": {"model": "tiny"}}))


def _train(*sets, config=TINY):
    args = ["--config", config, "--dry-run"]
    for item in sets:
        args += ["--set", item]
    return ("train.py", args)


# (id, entry point, argv, what the error line must name[, environment variables]). In argv
# and in the names, {d} is the fixture folder and {o} a fresh output folder.
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
    ("zero-stage-2", *_train("parallel.zero_stage=2"), "parallel.zero_stage=2"),
    ("wire-dtype-not-a-choice", *_train("parallel.grad_reduce_dtype=fp16"),
     "parallel.grad_reduce_dtype"),
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
    ("libreoffice-out-is-file", "make_libreoffice_corpus.py", ["--debs", "{d}/corpus", "--out",
     "{d}/a_file"], "--out"),
    ("libreoffice-out-in-debs", "make_libreoffice_corpus.py", ["--debs", "{d}/corpus", "--out",
     "{d}/corpus/lo"], "--out"),
    ("libreoffice-no-english-package", "make_libreoffice_corpus.py", ["--debs", "{d}/corpus",
     "--out", "{o}"], "apt-get download libreoffice-help-en-us"),
    ("inspect-missing-dataset", "inspect_shards.py", ["{o}"], "{o}"),
    ("convert-missing-checkpoint", "convert", ["to-hf", "--checkpoint", "{d}/nope", "--out",
     "{o}"], "nope"),
    ("convert-checkpoint-is-file", "convert", ["reshard", "--checkpoint", "{d}/a_file",
     "--out", "{o}", "--tp", "1", "--pp", "1"], "a_file"),
    ("convert-missing-model", "convert", ["from-hf", "--model", "{d}/nope", "--out", "{o}"],
     "nope"),
    # issue 30: conversions check what they read. Every stored tensor's name, shape and dtype
    # against the model the config describes, before anything is written; --out never is,
    # holds or lies inside an input, --force or not. Inputs from the `convert_inputs` fixture
    # ({d}/conv/...): a small transformers model, its from-hf checkpoint, tampered copies.
    ("convert-from-hf-config-fewer-layers", "convert", [
        "from-hf", "--model", "{d}/conv/fewer_layers", "--out", "{o}"],
     "tensor rembert.encoder.layer.2."),
    ("convert-from-hf-int8-weight", "convert", [
        "from-hf", "--model", "{d}/conv/int8", "--out", "{o}"],
     "tensor cls.predictions.dense.weight has dtype int8"),
    ("convert-from-hf-out-is-model-force", "convert", [
        "from-hf", "--model", "{d}/conv/model", "--out", "{d}/conv/model", "--force"], "--out"),
    ("convert-from-hf-out-inside-model-via-link", "convert", [
        "from-hf", "--model", "{d}/conv/model_link", "--out", "{d}/conv/model/ckpt"], "--out"),
    ("convert-reshard-wrong-shape", "convert", [
        "reshard", "--checkpoint", "{d}/conv/bad_shape", "--out", "{o}"],
     "tensor rembert.layers.0.ffn.output.weight has shape"),
    ("convert-average-float64", "convert", [
        "average", "--checkpoints", "{d}/conv/ckpt", "{d}/conv/float64", "--out", "{o}"],
     "tensor mlm_head.dense.weight has dtype float64"),
    ("convert-to-hf-missing-tensor", "convert", [
        "to-hf", "--checkpoint", "{d}/conv/missing", "--out", "{o}"],
     "tensor rembert.embeddings.layer_norm.bias"),
    ("convert-to-hf-out-holds-tokenizer-force", "convert", [
        "to-hf", "--checkpoint", "{d}/conv/ckpt", "--tokenizer", "{d}/conv/tok/spm.model",
        "--out", "{d}/conv/tok", "--force"], "--out"),
    ("convert-reshard-out-links-to-save-folder-force", "convert", [
        "reshard", "--checkpoint", "{d}/conv/ckpt", "--out", "{d}/conv/ckpt_link", "--force"],
     "--out"),
    # issue 30: paths read from files stay inside their folder (fs.inside): a dataset manifest
    # naming a shard or the word-start table by `..`, an absolute path or a symlink leading
    # out, for inspect and merge; a save folder's `latest` naming another run's checkpoint by
    # an absolute path, `..` or a step folder that is a symlink; a step folder's manifest.json
    # listing a file of another run. The error names the file the path was read from.
    ("manifest-shard-dotdot", "inspect_shards.py", ["{d}/ds_dotdot", "--verify"],
     "{d}/ds_dotdot/manifest.json: names '../victim/"),
    ("manifest-shard-absolute", "inspect_shards.py", ["{d}/ds_absolute", "--verify"],
     "{d}/ds_absolute/manifest.json: names '{d}/victim/"),
    ("manifest-shard-symlink-out", "inspect_shards.py", ["{d}/ds_symlink", "--verify"],
     "{d}/ds_symlink/manifest.json: names 'train/aa/"),
    ("manifest-word-starts-dotdot", "inspect_shards.py", ["{d}/ds_ws_dotdot"],
     "{d}/ds_ws_dotdot/manifest.json: names '../victim/word_starts.npy'"),
    ("merge-part-shard-dotdot", "merge_datasets.py", ["{d}/ds_dotdot", "--out", "{o}"],
     "{d}/ds_dotdot/manifest.json: names '../victim/"),
    ("merge-part-shard-absolute", "merge_datasets.py", ["{d}/ds_absolute", "--out", "{o}"],
     "{d}/ds_absolute/manifest.json: names '{d}/victim/"),
    ("merge-part-shard-symlink-out", "merge_datasets.py", ["{d}/ds_symlink", "--out", "{o}"],
     "{d}/ds_symlink/manifest.json: names 'train/aa/"),
    ("latest-absolute", "convert", ["to-hf", "--checkpoint", "{d}/run_latest_abs", "--out",
     "{o}"], "{d}/run_latest_abs/latest: names '{d}/other_run/step_00000002'"),
    ("latest-dotdot", "convert", ["reshard", "--checkpoint", "{d}/run_latest_dotdot", "--out",
     "{o}", "--tp", "1", "--pp", "1"], "{d}/run_latest_dotdot/latest: names '../other_run/"),
    ("latest-step-folder-symlink", "convert", ["to-hf", "--checkpoint", "{d}/run_step_link",
     "--out", "{o}"], "{d}/run_step_link/latest: names 'step_00000002'"),
    ("checkpoint-manifest-file-outside", "convert", ["to-hf", "--checkpoint",
     "{d}/run_manifest_out", "--out", "{o}"],
     "{d}/run_manifest_out/step_00000002/manifest.json: names '../../other_run/"),
    # issue 30: one error line from every failure
    # average reads every checkpoint's meta.json to compare them before loading any: the
    # manifest check comes first (a traceback before)
    ("meta-json-edited", "convert", ["average", "--checkpoints", "{d}/edited_meta",
     "{d}/edited_meta_too", "--out", "{o}"], "edited_meta/step_00000001/meta.json: "),
    ("launcher-rank-not-below-world", *_train(), "RANK must be in 0..1",
     {"RANK": "2", "WORLD_SIZE": "2"}),
    ("launcher-world-not-integer", *_train(), "WORLD_SIZE='two'", {"WORLD_SIZE": "two"}),
    ("launcher-local-rank-over-local-world", *_train(), "LOCAL_RANK must be below",
     {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1"}),
    ("launcher-world-without-rank", *_train(), "WORLD_SIZE > 1 without RANK",
     {"WORLD_SIZE": "4"}),
    # Not a --dry-run: the real start refuses before torch.distributed and the model. Sizes
    # no machine holds (thousands of GiB per rank), whatever this one has.
    ("memory-cannot-fit", "train.py", ["--config", TINY, "--set", "train.save_dir={o}/ckpt",
     "--set", "train.log_dir={o}/logs", "--set", "model.hidden_size=4096", "--set",
     "model.intermediate_size=16384", "--set", "model.num_attention_heads=32", "--set",
     "train.micro_batch_size=65536", "--set", "train.global_batch_size=65536"],
     "parallel.memory_check=false starts anyway"),
]


@pytest.fixture(scope="module")
def convert_inputs(files) -> Path:
    """{d}/conv: a small transformers RemBERT folder (`model`), its from-hf checkpoint
    (`ckpt`) and copies a converter must refuse (tests/convert/tampering.py)."""
    pytest.importorskip("transformers")
    from tests.convert.tampering import (
        copy_checkpoint,
        copy_hf,
        drop,
        reshape,
        save_hf_model,
        set_dtype,
    )

    conv = files / "conv"
    model = save_hf_model(conv / "model")
    copy_hf(model, conv / "fewer_layers", config={"num_hidden_layers": 2})
    copy_hf(model, conv / "int8", set_dtype("cls.predictions.dense.weight", torch.int8))
    assert convert_main(["from-hf", "--model", str(model), "--out", str(conv / "ckpt")]) == 0
    copy_checkpoint(conv / "ckpt", conv / "bad_shape", "layer_01.safetensors",
                    reshape("rembert.layers.0.ffn.output.weight"))
    copy_checkpoint(conv / "ckpt", conv / "float64", "layer_04.safetensors",
                    set_dtype("mlm_head.dense.weight", torch.float64))
    copy_checkpoint(conv / "ckpt", conv / "missing", "layer_00.safetensors",
                    drop("rembert.embeddings.layer_norm.bias"))
    (conv / "tok").mkdir()
    (conv / "tok" / "spm.model").write_bytes(b"not read: --out is refused first")
    (conv / "ckpt_link").symlink_to(conv / "ckpt")
    (conv / "model_link").symlink_to(model)
    return conv


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
def test_bad_input_is_one_error_line(case, files, tmp_path, capsys, monkeypatch, request):
    _, tool, argv, names, *env = case
    if any("{d}/conv/" in a for a in argv):
        request.getfixturevalue("convert_inputs")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env[0] if env else {}).items():  # the launcher's variables
        monkeypatch.setenv(name, value)
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
