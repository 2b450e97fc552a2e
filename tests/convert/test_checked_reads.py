"""Conversions check what they read: every stored tensor's name, shape and dtype against the
model the config describes, before anything is written; and --out is never an input, inside
one or holding one (through symlinks, --force or not). Each refusal is one `error:` line naming
the tensor or flag, and leaves no output."""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from megatron_rembert.checkpoint.portable import PortableReader
from megatron_rembert.convert.__main__ import main
from tests.convert.tampering import (
    add_copy,
    copy_checkpoint,
    copy_hf,
    drop,
    reshape,
    set_dtype,
)

pytest.importorskip("transformers")  # the hf_dir fixture (conftest.py)


def _refused(args: list, capsys, *names: str) -> str:
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for name in names:
        assert name in lines[0], err
    return lines[0]


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# -- the three attacks -------------------------------------------------------------------
def test_config_saying_fewer_layers_than_the_tensors_is_refused(hf_dir, tmp_path, capsys):
    """Was: the 3rd layer silently dropped, a 2-layer checkpoint written."""
    hf = copy_hf(hf_dir / "hf", tmp_path / "hf", config={"num_hidden_layers": 2})
    _refused(["from-hf", "--model", hf, "--out", tmp_path / "o"], capsys,
             f"{hf / 'model.safetensors'}: tensor rembert.encoder.layer.2.", "config.json",
             "more)")
    assert not (tmp_path / "o").exists()


def test_int8_weight_is_refused_not_cast(hf_dir, tmp_path, capsys):
    """Was: the int8 values cast to float32 and written as the weight to train from."""
    name = "rembert.encoder.layer.0.output.dense.weight"
    hf = copy_hf(hf_dir / "hf", tmp_path / "hf", set_dtype(name, torch.int8))
    _refused(["from-hf", "--model", hf, "--out", tmp_path / "o"], capsys, name, "int8")
    assert not (tmp_path / "o").exists()


def test_out_is_never_the_model_inside_it_or_holding_it(hf_dir, tmp_path, capsys):
    """Was: `--model X --out X --force` deleted X. Also through a symlink, and for the
    --config file from-hf reads."""
    hf = copy_hf(hf_dir / "hf", tmp_path / "models" / "hf")
    before = _hashes(tmp_path / "models")
    link = tmp_path / "link"
    link.symlink_to(hf)
    for out in (hf, hf / "ckpt", tmp_path / "models", link, link / "ckpt"):
        _refused(["from-hf", "--model", hf, "--out", out, "--force"], capsys, f"--out {out}",
                 "--model")
        _refused(["from-hf", "--model", link, "--out", out, "--force"], capsys, "--model")
    config = tmp_path / "configs" / "train.yaml"
    config.parent.mkdir()
    config.write_text("model:\n  preset: tiny\n")
    _refused(["from-hf", "--model", hf, "--config", config, "--out", config.parent, "--force"],
             capsys, "--config")
    assert _hashes(tmp_path / "models") == before and config.exists()


# -- from-hf: every kind of bad tensor --------------------------------------------------
LAYER0 = "rembert.encoder.layer.0."
HF_CASES = {
    "missing": (drop(LAYER0 + "attention.output.LayerNorm.bias"),
                ["the model needs tensor " + LAYER0 + "attention.output.LayerNorm.bias"]),
    "extra-layer": (add_copy(LAYER0 + "output.dense.weight",
                             "rembert.encoder.layer.3.output.dense.weight"),
                    ["rembert.encoder.layer.3.output.dense.weight", "is not a parameter"]),
    "unknown-name": (add_copy(LAYER0 + "output.dense.weight", LAYER0 + "output.gate.weight"),
                     [LAYER0 + "output.gate.weight"]),
    "same-parameter-twice": (add_copy(LAYER0 + "output.dense.weight",
                                      "encoder.layer.0.output.dense.weight"),
                             ["encoder.layer.0.output.dense.weight", "same parameter"]),
    "wrong-shape": (reshape(LAYER0 + "intermediate.dense.weight"),
                    [LAYER0 + "intermediate.dense.weight", "shape (95, 48)"]),
    "float64": (set_dtype("cls.predictions.decoder.weight", torch.float64),
                ["cls.predictions.decoder.weight", "float64"]),
    "int64": (set_dtype("rembert.embeddings.word_embeddings.weight", torch.int64),
              ["rembert.embeddings.word_embeddings.weight", "int64"]),
    "bool": (set_dtype("cls.predictions.LayerNorm.weight", torch.bool),
             ["cls.predictions.LayerNorm.weight", "bool"]),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_from_hf_refuses_bad_tensors(hf_dir, tmp_path, capsys, case):
    edit, names = HF_CASES[case]
    hf = copy_hf(hf_dir / "hf", tmp_path / "hf", edit)
    _refused(["from-hf", "--model", hf, "--out", tmp_path / "o"], capsys, *names)
    assert not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".o.")]  # no debris


def test_from_hf_pickle_and_sharded_index_are_checked_too(hf_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    name = "rembert.encoder.layer.1.attention.self.key.bias"
    tensors = load_file(hf_dir / "hf" / "model.safetensors")
    hf = copy_hf(hf_dir / "hf", tmp_path / "bin")
    (hf / "model.safetensors").unlink()
    torch.save({**tensors, name: tensors[name].to(torch.int16)}, hf / "pytorch_model.bin")
    _refused(["from-hf", "--model", hf, "--out", tmp_path / "o"], capsys,
             "pytorch_model.bin: tensor " + name, "int16")
    sharded = copy_hf(hf_dir / "hf", tmp_path / "sharded")
    (sharded / "model.safetensors").rename(tmp_path / "outside.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys(tensors, "../outside.safetensors")}))
    _refused(["from-hf", "--model", sharded, "--out", tmp_path / "o"], capsys,
             "model.safetensors.index.json: shard '../outside.safetensors' lies outside")
    assert not (tmp_path / "o").exists()


def test_half_precision_weights_still_convert(hf_dir, tmp_path):
    """The check refuses what is wrong, not what is merely not float32: bf16 weights convert
    to the same values in fp32."""
    name = "rembert.encoder.layer.0.output.dense.weight"
    hf = copy_hf(hf_dir / "hf", tmp_path / "hf", set_dtype(name, torch.bfloat16))
    assert main(["from-hf", "--model", str(hf), "--out", str(tmp_path / "o")]) == 0
    from safetensors.torch import load_file

    expected = load_file(hf / "model.safetensors")[name].float()
    with PortableReader(tmp_path / "o" / "step_00000000") as reader:
        assert torch.equal(reader.full("rembert.layers.0.ffn.output.weight"), expected)


# -- reading a checkpoint: to-hf, export-encoder, reshard, average ------------------------
CKPT_CASES = {
    "int32": ("layer_01.safetensors", set_dtype("rembert.layers.0.attention.query.weight",
                                                torch.int32), None,
              ["layer_01.safetensors: tensor rembert.layers.0.attention.query.weight", "int32"]),
    "float64": ("layer_04.safetensors", set_dtype("mlm_head.decoder.weight", torch.float64),
                None, ["layer_04.safetensors: tensor mlm_head.decoder.weight", "float64"]),
    "wrong-shape": ("layer_00.safetensors", reshape("rembert.embeddings.word_embeddings.weight"),
                    None, ["rembert.embeddings.word_embeddings.weight", "(299, 16)",
                           "needs (300, 16)"]),
    "extra": ("layer_02.safetensors", add_copy("rembert.layers.1.ffn.output.weight",
                                               "rembert.layers.1.ffn.gate.weight"), None,
              ["layer_02.safetensors: tensor rembert.layers.1.ffn.gate.weight"]),
    "missing": ("layer_03.safetensors", drop("rembert.layers.2.ffn_norm.bias"), None,
                ["meta.json: the model needs tensor rembert.layers.2.ffn_norm.bias"]),
    "fewer-layers-in-meta": (None, None, {"num_hidden_layers": 2},
                             ["layer_03.safetensors: tensor rembert.layers.2.", "more)"]),
}
COMMANDS = {
    "to-hf": lambda bad, out: ["to-hf", "--checkpoint", bad, "--out", out],
    "export-encoder": lambda bad, out: ["export-encoder", "--checkpoint", bad, "--out", out],
    "reshard": lambda bad, out: ["reshard", "--checkpoint", bad, "--out", out],
    # twice: a weighted mean of one model (with a good checkpoint of 3 layers, the models'
    # comparison would refuse the fewer-layers case first)
    "average": lambda bad, out: ["average", "--checkpoints", bad, bad, "--out", out],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(CKPT_CASES))
def test_checkpoint_readers_refuse_bad_tensors(hf_dir, tmp_path, capsys, case, command):
    file, edit, model, names = CKPT_CASES[case]
    bad = copy_checkpoint(hf_dir / "ckpt", tmp_path / "bad", file, edit, model)
    _refused(COMMANDS[command](bad, tmp_path / "o"), capsys, *names)
    assert not (tmp_path / "o").exists()


def test_checkpoint_out_kept_apart_from_every_input(hf_dir, tmp_path, capsys):
    """The save folder through a symlink, an average's inputs, the tokenizer to-hf reads."""
    save = copy_checkpoint(hf_dir / "ckpt", tmp_path / "run")
    before = _hashes(save)
    link = tmp_path / "link"
    link.symlink_to(save)
    _refused(["reshard", "--checkpoint", save, "--out", link, "--force"], capsys,
             f"--out {link}: is, holds or lies inside the checkpoint's own save folder {save}")
    _refused(["reshard", "--checkpoint", save / "step_00000000", "--out", link, "--force"],
             capsys, "own save folder")
    _refused(["reshard", "--checkpoint", link / "step_00000000", "--out", save / "resharded"],
             capsys, "--out")
    _refused(["average", "--checkpoints", hf_dir / "ckpt", save, "--out", link / "x",
              "--force"], capsys, "--out")
    tokenizer = tmp_path / "tok" / "spm.model"
    tokenizer.parent.mkdir()
    tokenizer.write_bytes(b"never read: --out is refused first")
    for out in (tokenizer, tokenizer.parent, tmp_path):
        _refused(["to-hf", "--checkpoint", save, "--tokenizer", tokenizer, "--out", out,
                  "--force"], capsys, f"--out {out}")
    assert _hashes(save) == before and tokenizer.exists()


def test_weights_are_read_only_by_safetensors_or_guarded_torch_load():
    """Every `torch.load` in the package is the one guarded call (checkpoint/files.py,
    weights_only=True), and nothing unpickles otherwise: a file from outside can carry code
    only through a pickle."""
    import ast

    package = Path(__file__).resolve().parents[2] / "megatron_rembert"
    loads = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value
            called = f"{getattr(owner, 'id', '?')}.{node.func.attr}"
            keywords = {k.arg: getattr(k.value, "value", None) for k in node.keywords}
            if called in ("pickle.load", "pickle.loads", "torch.load") or (
                    called == "np.load" and keywords.get("allow_pickle")):
                loads.append((str(path.relative_to(package)), called, keywords))
    # data/loader.py unpickles only what its own parent process pickled for its workers.
    assert [(f, c) for f, c, _ in loads] == [("checkpoint/files.py", "torch.load"),
                                             ("data/loader.py", "pickle.loads")], loads
    assert loads[0][2].get("weights_only") is True


def test_trained_output_embedding_is_not_dropped_for_a_tied_config(tmp_path, capsys):
    """A training config with tied embeddings has no output embedding parameter: the
    transformers decoder weight (trained apart from the input embedding) is refused by name,
    not dropped."""
    import transformers

    from megatron_rembert.convert.hf import HF_FIELDS, hf_config_dict
    from tests.model.helpers import small_config

    model = small_config(input_embedding_size=40)  # tying needs equal embedding sizes
    transformers.RemBertForMaskedLM(transformers.RemBertConfig(
        **hf_config_dict(model))).save_pretrained(tmp_path / "hf")
    capsys.readouterr()  # transformers' progress bar
    config = tmp_path / "tied.yaml"
    config.write_text("model:\n" + "".join(f"  {k}: {getattr(model, k)}\n" for k in HF_FIELDS)
                      + "  tie_embeddings: true\n")
    _refused(["from-hf", "--model", tmp_path / "hf", "--config", config, "--out",
              tmp_path / "o"], capsys, "tensor cls.predictions.decoder.weight is not a parameter")
    assert not (tmp_path / "o").exists()
