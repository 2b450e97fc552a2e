"""Text -> tokenizer -> shards -> decode: nothing lost, duplicated or reordered."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_rembert.data.common import SpecialIds
from megatron_rembert.data.shards import ShardDataset
from megatron_rembert.prep.corpus import SkipStats, discover_corpus, iter_documents
from megatron_rembert.prep.demo_corpus import LANGUAGES
from megatron_rembert.prep.preprocess import is_valid_doc
from megatron_rembert.prep.tokenizer import load_sentencepiece
from tests.data.conftest import SEQ

ROOT = Path(__file__).resolve().parents[2]


def test_tokenizer_special_ids_and_json(tokenizer):
    sp = load_sentencepiece(tokenizer)
    assert [sp.id_to_piece(i) for i in range(5)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    info = json.loads(tokenizer.with_suffix(".json").read_text())
    assert info["special_ids"] == SpecialIds().to_dict()
    assert info["vocab_size"] == 1000
    # alpha = 0.5 flattens the distribution: the smallest language is upsampled
    langs = info["languages"]
    small = min(langs, key=lambda k: langs[k]["chunks"])
    big = max(langs, key=lambda k: langs[k]["chunks"])
    assert langs[small]["sampled"] > langs[small]["chunks"]
    assert langs[big]["sampled"] < langs[big]["chunks"]
    # text containing "[MASK]" must not produce the control token
    assert 4 not in sp.encode("ab [MASK] cd")


def test_demo_corpus_scripts(corpus):
    assert len(LANGUAGES) >= 8 and len({x.script[:4] for x in LANGUAGES}) >= 5
    files, _ = discover_corpus(corpus)
    assert sorted(files) == sorted(x.code for x in LANGUAGES)


def test_round_trip(corpus, tokenizer, dataset):
    sp = load_sentencepiece(tokenizer)
    files, _ = discover_corpus(corpus)
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert manifest["seq_length"] == SEQ
    for split in ("train", "valid"):
        ds = ShardDataset(dataset, split, seq_length=SEQ)
        for lang in ds.languages:
            rows = ds.get(np.full(ds.rows_per_language[lang], ds.languages.index(lang)),
                          np.arange(ds.rows_per_language[lang]))
            assert (rows[:, 0] == 2).all()
            # the stream of tokens in the shards, without [CLS]/[SEP]/[PAD]
            got = rows[~np.isin(rows, [0, 2, 3])]
            docs = [t for cf in files[lang] for line, t in iter_documents(cf, SkipStats())
                    if is_valid_doc(cf.rel, line, 0.05) == (split == "valid")]
            want = np.concatenate([np.asarray(sp.encode(d)) for d in docs])
            np.testing.assert_array_equal(got, want)
            # decoding the shard tokens gives back the original text (where no piece is [UNK])
            lens = np.cumsum([len(sp.encode(d)) for d in docs])
            for k in range(min(5, len(docs))):
                piece = got[(lens[k - 1] if k else 0): lens[k]].tolist()
                if 1 not in piece:
                    assert sp.decode(piece) == docs[k]


@pytest.mark.multiprocess
def test_cli_end_to_end(tmp_path):
    """The thin scripts run as `python data_tools/X.py` and chain together."""
    def run(*args):
        r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout

    run("data_tools/make_demo_corpus.py", "--out", str(tmp_path / "c"), "--size-mb", "0.3",
        "--languages", "latn_a", "cyrl", "hani")
    run("data_tools/train_tokenizer.py", "--corpus", str(tmp_path / "c"), "--out",
        str(tmp_path / "spm"), "--vocab-size", "600", "--threads", "1")
    out = run("data_tools/preprocess.py", "--corpus", str(tmp_path / "c"), "--tokenizer",
              str(tmp_path / "spm.model"), "--out", str(tmp_path / "d"), "--seq-length", "64",
              "--workers", "1", "--no-progress")
    assert "hani" in out and "train seqs" in out
    out = run("data_tools/inspect_shards.py", str(tmp_path / "d"), "--verify", "--decode", "2",
              "--tokenizer", str(tmp_path / "spm.model"))
    assert "verify: 0 problem(s)" in out and out.count("--- [") == 2


def test_packer_rows():
    from megatron_rembert.prep.packing import Packer

    p = Packer(8, SpecialIds(), np.zeros(0, np.int32), np.zeros((0, 8), np.int32))
    p.add(np.arange(10, 23))  # 13 tokens: two full rows of 6, one token carried over
    p.add(np.arange(30, 34))  # [SEP] + 4 tokens complete the third row
    p.add(np.arange(40, 45))  # carried [] -> starts a fresh row, no leading [SEP]
    p.flush_partial()
    rows = p.take(p.n_rows)
    np.testing.assert_array_equal(rows, [
        [2, 10, 11, 12, 13, 14, 15, 3],
        [2, 16, 17, 18, 19, 20, 21, 3],
        [2, 22, 3, 30, 31, 32, 33, 3],
        [2, 40, 41, 42, 43, 44, 3, 0],
    ])
    q = Packer(8, SpecialIds(), np.zeros(0, np.int32), np.zeros((0, 8), np.int32))
    q.add(np.arange(10, 15))  # 5 of 6 slots used: no room for [SEP] + text
    q.add(np.arange(20, 22))
    q.flush_partial()
    np.testing.assert_array_equal(q.take(5), [[2, 10, 11, 12, 13, 14, 3, 0],
                                              [2, 20, 21, 3, 0, 0, 0, 0]])


def test_progress_bar_shows_elapsed_and_eta_in_a_log_file(monkeypatch, capsys):
    """Not a terminal (a SLURM log): one plain line per redraw, with elapsed time and the ETA
    from the mean rate so far."""
    from megatron_rembert.prep import progress

    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    bar = progress.ProgressBar(total=4_000_000, label="preprocess")
    now[0] += 90.0  # a quarter of the bytes in 1.5 min: 4.5 min to go
    bar.update(1_000_000, force=True)
    line = capsys.readouterr().err
    assert line.endswith("\n") and "\r" not in line
    assert " 25.0% " in line and "elapsed 0:01:30 eta 0:04:30" in line, line
