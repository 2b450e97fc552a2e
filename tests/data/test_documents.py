"""The block parser's fast paths (one decode per block, C loops over the lines) and the
vectorised validation split, each against a plain per-line statement of the same rules."""

from __future__ import annotations

import json
import threading
import zlib

import numpy as np

from megatron_rembert.prep import preprocess as pre
from megatron_rembert.prep.corpus import LineBlock, SkipStats, documents_in_block
from tests.data.conftest import small_config

LIMIT = 40  # max_line_bytes: some blocks are shorter than it (no line can be too long), most not


def _reference(data: bytes, first: int, kind: str) -> tuple[list[tuple[int, str]], SkipStats]:
    """docs/data.md's rules, one line at a time."""
    stats, docs = SkipStats(), []
    for n, line in enumerate(data.split(b"\n")[:-1], first):
        if len(line) > LIMIT:
            stats.long_lines += 1
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            stats.bad_utf8_lines += 1
            continue
        if kind == "jsonl":
            if not text.strip():
                stats.blank_lines += 1
                continue
            try:
                obj = json.loads(text)
            except ValueError:
                obj = None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                stats.bad_json_lines += 1
                continue
            text = obj["text"]
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                stats.bad_utf8_lines += 1
                continue
        text = text.lstrip("\ufeff").strip()
        if not text:
            stats.blank_lines += 1
            continue
        docs.append((n, text))
    return docs, stats


# Texts with every edge the rules have: blanks of several kinds (Unicode spaces that only
# str.strip removes), byte-order marks at the start and inside, non-ASCII text.
TEXTS = ["da kepuga", "  votuzu ", "", " \t ", "\u3000ideo\u3000", "\xa0nbsp", "\ufeffbom",
         " \ufeffinner", "\u00e9t\u00e9", "на зату", "\x1cfs\x1f", "x" * 30]


def _line(rng, kind: str) -> bytes:
    r = rng.random()
    if r < 0.08:
        return b"bad \xff\xfe utf8"
    if r < 0.14:
        return b"y" * int(rng.integers(LIMIT + 1, 3 * LIMIT))  # too long
    text = TEXTS[int(rng.integers(len(TEXTS)))]
    if kind == "txt":
        return text.encode()
    if r < 0.22:
        return rng.choice([b"{not json", b'{"txt": "x"}', b"[1, 2]", b'{"text": 3}',
                           b'{"text": "\\ud800"}', b"  ", b'{"text": "a"} {"text": "b"}',
                           b' {"text": "blank first"}', b'{"text": "two"}\t',
                           b'{"text": "\\ud83d\\ude00 pair"}', b'{"text": "\\uDC00"}',
                           b'{"text": "x", "text": "last wins"}', b'{"text": NaN}',
                           b'{"text": "\\ufeff bom"}'])
    return json.dumps({"text": text}, ensure_ascii=bool(rng.random() < 0.5)).encode()


def test_block_parser_equals_the_per_line_rules():
    rng = np.random.default_rng(0)
    for trial in range(600):
        kind = "jsonl" if trial % 2 else "txt"
        clean = trial % 3 == 0  # no bad or long line: the one-decode path throughout
        lines = []
        for _ in range(int(rng.integers(1, 12))):
            line = _line(rng, kind)
            while clean and (len(line) > LIMIT or b"\xff" in line):
                line = _line(rng, kind)
            lines.append(line)
        data = b"\n".join(lines) + b"\n"
        first = int(rng.integers(0, 1000))
        stats = SkipStats()
        numbers, texts = documents_in_block(LineBlock(first, len(lines), data), kind, LIMIT,
                                            stats)
        want_docs, want_stats = _reference(data, first, kind)
        assert list(zip(numbers, texts, strict=True)) == want_docs, (kind, data)
        assert stats == want_stats, (kind, data)


def test_valid_docs_is_the_documented_crc():
    rng = np.random.default_rng(1)
    lines = sorted(set(rng.integers(0, 10**7, 5000).tolist()))
    for rel, fraction in (("en/a.txt", 0.3), ("zh_hans/b c.jsonl.gz", 0.005), ("x/y.txt", 0.0)):
        got = pre.valid_docs(rel, lines, fraction)
        want = [zlib.crc32(f"{rel}\n{n}".encode()) < fraction * 2**32 for n in lines]
        assert got.tolist() == want
    assert 1000 < int(pre.valid_docs("en/a.txt", lines, 0.3).sum()) < 2000
    assert pre.valid_docs("en/a.txt", [], 0.3).tolist() == []


def test_workers_encode_in_their_threads(corpus, tokenizer, tmp_path, monkeypatch):
    """--workers N runs SentencePiece on N pool threads, not on the main thread (the output is
    the same either way, so only this shows the pool is used)."""
    names = []
    make = pre._buffer_encoder

    def spying(sp):
        encode = make(sp)

        def spy(texts):
            names.append(threading.current_thread().name)
            return encode(texts)
        return spy

    monkeypatch.setattr(pre, "_buffer_encoder", spying)
    pre.preprocess(small_config(corpus, tmp_path / "out", tokenizer, workers=2,
                                block_bytes=2000))
    assert len(names) > 4
    assert threading.main_thread().name not in names
    assert 1 <= len(set(names)) <= 2
