"""Bad input to rembert-eval: one `error:` line naming the file and line, field or flag, exit
2, and no weight loaded."""

import json
import shutil

import pytest

from megatron_rembert.eval import encoder, suite
from megatron_rembert.eval.cli import main

GOOD = {"id": "1", "text": "Hallo Welt", "en": "hello world"}


def _jsonl(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


# name: (files under tmp, extra args, the words the line must hold)
CASES = {
    "no_folder": ({}, ["--parallel", "{tmp}/nowhere"], "--parallel {tmp}/nowhere: no such folder"),
    "no_sets": ({"p/readme.txt": "x"}, ["--parallel", "{tmp}/p"],
                "no <lang>.jsonl or <lang>.tsv files"),
    "bad_json": ({"p/de.jsonl": _jsonl(GOOD, '{"id": 2, "text": ')}, ["--parallel", "{tmp}/p"],
                 "p/de.jsonl:2: not a JSON object"),
    "missing_field": ({"p/de.jsonl": _jsonl({"id": "1", "text": "a"})},
                      ["--parallel", "{tmp}/p"], "p/de.jsonl:1: missing field 'en'"),
    "empty_field": ({"p/de.jsonl": _jsonl({**GOOD, "en": "  "})}, ["--parallel", "{tmp}/p"],
                    "p/de.jsonl:1: field 'en' is empty"),
    "empty_set": ({"p/de.jsonl": "\n\n"}, ["--parallel", "{tmp}/p"],
                  "p/de.jsonl: no pairs (an empty file)"),
    "tsv_columns": ({"p/fr.tsv": "a\tb\nc\td\te\n"}, ["--parallel", "{tmp}/p"],
                    "p/fr.tsv:2: expected <text> TAB <English text>, found 3 tab-separated fields"),
    "two_files_one_lang": ({"p/fr.tsv": "a\tb\n", "p/fr.jsonl": _jsonl(GOOD)},
                           ["--parallel", "{tmp}/p"], "give language 'fr'"),
    "unknown_layer": ({"p/de.jsonl": _jsonl(GOOD)}, ["--parallel", "{tmp}/p", "--layer", "4"],
                      "--layer 4: expected 0 (embeddings) .. 3"),
    "layer_word": ({"p/de.jsonl": _jsonl(GOOD)}, ["--parallel", "{tmp}/p", "--layer", "mid"],
                   "--layer mid: expected"),
    "too_long": ({"p/de.jsonl": _jsonl(GOOD)}, ["--parallel", "{tmp}/p", "--max-length",
                                                 "500"], "--max-length 500: the model has 128"),
    "baseline": ({"p/de.jsonl": _jsonl(GOOD)}, ["--parallel", "{tmp}/p", "--baselines",
                                                 "step0,random"], "unknown ['random']"),
    "nothing": ({}, [], "nothing to evaluate"),
    "half_classify": ({"t.jsonl": "x"}, ["--classify-train", "{tmp}/t.jsonl"],
                      "--classify-train and --classify-test go together"),
    "no_train_file": ({"t.jsonl": _jsonl({"id": "1", "lang": "en", "label": 1, "text": "a"})},
                      ["--classify-train", "{tmp}/x.jsonl", "--classify-test", "{tmp}/t.jsonl"],
                      "--classify-train {tmp}/x.jsonl: no such file"),
    "no_label": ({"t.jsonl": _jsonl({"id": "1", "lang": "en", "text": "a"})},
                 ["--classify-train", "{tmp}/t.jsonl", "--classify-test", "{tmp}/t.jsonl"],
                 "t.jsonl:1: missing field 'label'"),
    "no_train_lang": ({"t.jsonl": _jsonl({"id": "1", "lang": "de", "label": 1, "text": "a"})},
                      ["--classify-train", "{tmp}/t.jsonl", "--classify-test", "{tmp}/t.jsonl"],
                      "no examples of --train-lang 'en'"),
    "unseen_label": ({"a.jsonl": _jsonl(*({"id": str(i), "lang": "en", "label": i % 2,
                                           "text": "a"} for i in range(4))),
                      "b.jsonl": _jsonl({"id": "1", "lang": "de", "label": 5, "text": "b"})},
                     ["--classify-train", "{tmp}/a.jsonl", "--classify-test", "{tmp}/b.jsonl"],
                     "label '5' (language de) never occurs in the training examples"),
    "out_is_folder": ({"p/de.jsonl": _jsonl(GOOD), "o/x": ""},
                      ["--parallel", "{tmp}/p", "--out", "{tmp}/o"], "--out {tmp}/o: is a folder"),
    "epochs": ({}, ["--epochs", "0"], "--epochs 0: must be >= 1"),
    "device": ({"p/de.jsonl": _jsonl(GOOD)}, ["--parallel", "{tmp}/p", "--device", "tpu"],
               "--device tpu: expected cpu, cuda or cuda:N"),
}


@pytest.fixture
def no_weights(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before the input was checked")

    monkeypatch.setattr(encoder.ModelSource, "load_encoder", refuse)
    monkeypatch.setattr(suite, "step0_encoder", refuse)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_error_line(case, checkpoint, tmp_path, capsys, no_weights):
    files, args, words = CASES[case]
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["--checkpoint", str(checkpoint), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert words.replace("{tmp}", str(tmp_path)) in err, err


def test_model_and_tokenizer_problems(checkpoint, tokenizer, tmp_path, capsys, no_weights):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "de.jsonl").write_text(_jsonl(GOOD))
    other = tmp_path / "other.model"
    other.write_bytes(tokenizer.read_bytes() + b"\0")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "rembert", "vocab_size": 1000}))
    (hf / "pytorch_model.bin").write_bytes(b"not read")
    step = next(checkpoint.glob("step_*"))
    no_complete = tmp_path / "ckpt" / step.name
    shutil.copytree(step, no_complete)
    (no_complete / "complete").unlink()
    for args, words in (
            (["--checkpoint", str(checkpoint), "--tokenizer", str(other)],
             f"--tokenizer {other}: its sha256 differs"),
            (["--checkpoint", str(checkpoint), "--tokenizer", str(tmp_path / "none.model")],
             "none.model: no such file"),
            (["--hf", str(hf)], "no model.safetensors"),
            (["--hf", str(tmp_path / "p")], "no config.json"),
            (["--checkpoint", str(no_complete)], "no 'complete' marker")):
        assert main([*args, "--parallel", str(tmp_path / "p")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and words in err, err
