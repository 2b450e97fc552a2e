"""rembert-eval end to end on a small model: identical sides score 1, unrelated pairs score
about chance, the bag-of-tokens baseline equals a hand computation, a checkpoint and its
transformers exports give the same figures, the JSON is what docs/eval.md says."""

import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import sentencepiece as spm

from megatron_rembert.eval.cli import main
from tests.eval.helpers import tiny_model_config, write_checkpoint
from tests.eval.sets import N

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], tmp_path: Path, capsys) -> dict:
    out = tmp_path / "r.json"
    assert main([*args, "--out", str(out), "--quiet"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "Retrieval accuracy@1" in printed or "Zero-shot" in printed
    return json.loads(out.read_text())


def test_identical_sides_score_one_unrelated_pairs_chance(checkpoint, parallel, tmp_path,
                                                          capsys):
    doc = run(["--checkpoint", str(checkpoint), "--parallel", str(parallel), "--layer", "all"],
              tmp_path, capsys)
    res = doc["retrieval"]
    same, shuffled = res["languages"]["same"], res["languages"]["shuffled"]
    assert same["pairs"] == N and same["pairs_read"] == N + 1
    assert same["duplicates_dropped"] == 1 and same["identical_pairs"] == N
    assert res["layer"] == 2  # 3 layers: the middle one, (3 + 1) // 2
    for system in ("model", "step0"):
        assert len(res["per_layer"][system]) == 4  # embeddings + 3 layers
        for layer in res["per_layer"][system]:
            assert layer["languages"]["same"] == {"to_en": 1.0, "from_en": 1.0}
            for value in layer["languages"]["shuffled"].values():
                assert value <= 4 / N  # chance is 1/N
    assert same["bag"] == {"to_en": 1.0, "from_en": 1.0}
    assert shuffled["chance"] == pytest.approx(1 / N)
    assert res["average"]["model"]["to_en"] == pytest.approx(
        sum(e["model"]["to_en"] for e in res["languages"].values()) / 3)


def _hand_bag(tokenizer: Path, texts: list[str], english: list[str], tfidf: bool,
              centered: bool = False):
    """Token-count (or tf-idf) cosine nearest neighbours, in plain Python; `centered`: each
    side's vectors minus that side's mean vector first."""
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    bags = [Counter(sp.encode(t)[:126]) for t in texts + english]
    if tfidf:
        n = len(bags)
        df = Counter(tok for bag in bags for tok in bag)
        bags = [{k: v * (math.log((1 + n) / (1 + df[k])) + 1) for k, v in bag.items()}
                for bag in bags]

    def cos(x, y):
        dot = sum(v * y.get(k, 0) for k, v in x.items())
        return dot / math.sqrt(sum(v * v for v in x.values()) * sum(v * v for v in y.values()))

    src, tgt = bags[:len(texts)], bags[len(texts):]
    if centered:
        def minus_mean(side):
            keys = {k for bag in side for k in bag}
            mean = {k: sum(bag.get(k, 0) for bag in side) / len(side) for k in keys}
            return [{k: bag.get(k, 0) - mean[k] for k in keys} for bag in side]
        src, tgt = minus_mean(src), minus_mean(tgt)

    def acc(a, b):
        """(lowest, highest) accuracy@1: a row whose own translation ties (to 1e-6) with the
        best other candidate may go either way in float32, so it counts only in `highest`."""
        sure = tied = 0
        for i, x in enumerate(a):
            scores = [cos(x, y) for y in b]
            best_other = max(s for j, s in enumerate(scores) if j != i)
            sure += scores[i] > best_other + 1e-6
            tied += abs(scores[i] - best_other) <= 1e-6
        return sure / len(a), (sure + tied) / len(a)

    return {"to_en": acc(src, tgt), "from_en": acc(tgt, src)}


@pytest.mark.parametrize("weighting,centered", [("counts", False), ("tfidf", False),
                                                ("counts", True)])
def test_bag_of_tokens_equals_a_hand_computation(checkpoint, parallel, tokenizer, tmp_path,
                                                 capsys, weighting, centered):
    doc = run(["--checkpoint", str(checkpoint), "--parallel", str(parallel), "--baselines",
               "bag", "--bag-weighting", weighting, *(["--center"] if centered else [])],
              tmp_path, capsys)
    assert doc["settings"]["center"] is centered
    for lang in ("noisy", "shuffled"):
        rows = [json.loads(line) for line in (parallel / "noisy.jsonl").read_text().splitlines()]
        if lang == "noisy":
            texts, english = [r["text"] for r in rows], [r["en"] for r in rows]
        else:
            pairs = [line.split("\t") for line in
                     (parallel / "shuffled.tsv").read_text().splitlines()]
            texts, english = [p[0] for p in pairs], [p[1] for p in pairs]
        expected = _hand_bag(tokenizer, texts, english, weighting == "tfidf", centered)
        for way, (low, high) in expected.items():
            got = doc["retrieval"]["languages"][lang]["bag"][way]
            assert low - 1e-6 <= got <= high + 1e-6, (lang, way, got, low, high)
            assert high - low <= 0.05  # ties are rare: the comparison keeps its teeth
    noisy = doc["retrieval"]["languages"]["noisy"]["bag"]["to_en"]
    assert 0.1 < noisy < 1.0  # the case tests something


def _figures(doc: dict) -> dict:
    """Every number of the results, by its key path (the model identity left out)."""
    out = {}

    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")
        elif isinstance(node, float):
            out[path] = node
    for key in ("retrieval", "classification"):
        walk(doc.get(key), key)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoint_and_its_exports_give_the_same_figures(tmp_path, tokenizer, parallel,
                                                          corpus_and_tokenizer, capsys, dtype):
    pytest.importorskip("tokenizers")
    import torch

    from megatron_rembert.convert.__main__ import main as convert
    from tests.eval.sets import classification

    save = tmp_path / "save"
    write_checkpoint(save, tiny_model_config(), tokenizer, dtype=getattr(torch, dtype))
    train, test = classification(tmp_path / "cls", corpus_and_tokenizer[0], False, 40, 20)
    args = ["--parallel", str(parallel), "--classify-train", str(train), "--classify-test",
            str(test), "--seeds", "2", "--epochs", "1", "--lr", "1e-3"]
    if dtype == "bfloat16":
        args += ["--skip-classify"]
    ours = run(["--checkpoint", str(save), *args], tmp_path, capsys)
    assert ours["model"]["step"] == 7
    for command in ("to-hf", "export-encoder"):
        assert convert([command, "--checkpoint", str(save), "--out",
                        str(tmp_path / command)]) == 0
        capsys.readouterr()
        theirs = run(["--hf", str(tmp_path / command), *args], tmp_path, capsys)
        a, b = _figures(ours), _figures(theirs)
        assert sorted(a) == sorted(b) and len(a) > 20
        for key, value in a.items():
            assert b[key] == pytest.approx(value, abs=1e-6), (command, key)
        assert theirs["model"]["parameters"] == ours["model"]["parameters"]
        assert theirs["model"]["config"] == ours["model"]["config"]


def _schema_paths(doc: dict) -> set[str]:
    """Key paths of a result: languages as <lang>, the model's and step 0's figures as
    <encoder>, items of a list of objects as []."""
    out = set()

    def walk(node, path, under_languages=False):
        if path == "model.config":  # the model's fields, as docs/configs.md lists them
            out.add(path)
        elif isinstance(node, dict):
            for k, v in node.items():
                if under_languages:
                    k = "<lang>"
                elif k in ("model", "step0") and path:  # both encoders' figures alike
                    k = "<encoder>"
                walk(v, f"{path}.{k}" if path else k, k == "languages" and isinstance(v, dict))
        elif isinstance(node, list) and node and isinstance(node[0], dict):
            for v in node:
                walk(v, path + "[]")
        else:
            out.add(path)
    walk(doc, "")
    return out


def test_json_schema_is_the_documented_one(checkpoint, parallel, corpus_and_tokenizer,
                                           tmp_path, capsys):
    from tests.eval.sets import classification

    train, test = classification(tmp_path / "cls", corpus_and_tokenizer[0], False, 30, 10)
    out = tmp_path / "r.json"
    assert main(["--checkpoint", str(checkpoint), "--parallel", str(parallel), "--layer",
                 "all", "--classify-train", str(train), "--classify-test", str(test),
                 "--seeds", "2", "--epochs", "1", "--out", str(out), "--quiet"]) == 0
    text = out.read_text()
    doc = json.loads(text)
    assert text == json.dumps(doc, indent=1, sort_keys=True)  # sorted keys
    block = re.search(r"<!-- schema -->\n```\n(.*?)```", (ROOT / "docs" / "eval.md").read_text(),
                      re.S).group(1)
    documented = {line.split()[0] for line in block.splitlines() if line.strip()}
    assert _schema_paths(doc) == documented



def run_command(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """rembert-eval as a user runs it: its own process, DS_ACCELERATOR unset."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "megatron_rembert.eval.cli", *args], env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=900)
