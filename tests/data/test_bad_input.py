"""Bad corpus input: counted skips or clear errors naming the path."""

from __future__ import annotations

import codecs
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rembert.data.common import DataError
from megatron_rembert.prep.corpus import (
    SkipStats,
    discover_corpus,
    iter_documents,
    iter_line_blocks,
)
from megatron_rembert.prep.preprocess import preprocess
from megatron_rembert.prep.tokenizer import train_tokenizer
from tests.data.conftest import small_config

ROOT = Path(__file__).resolve().parents[2]


def _write(path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.fixture()
def messy_corpus(tmp_path):
    c = tmp_path / "corpus"
    good = "da kepuga muhebova ha votuzu. te rateri gavava ha liri votuzu.\n"
    _write(c / "aa" / "a.txt", (good * 3 + "\n   \n" + good).encode()  # 2 blank lines
           + b"bad \xff\xfe utf8\n"  # 1 non-UTF-8 line
           + b"x" * 5000 + b"\n"  # 1 line over --max-line-bytes (4096 below)
           + good.encode())
    _write(c / "aa" / "empty.txt", b"")  # empty file
    _write(c / "aa" / "notes.pdf", b"%PDF")  # unknown type
    _write(c / "README", b"top-level file")  # not in a language folder
    lines = [json.dumps({"text": "на зату мятипо фы дыли шесу."}), "{not json",
             json.dumps({"txt": "wrong field"}), json.dumps({"text": "гены киборя фы."})]
    _write(c / "bb" / "b.jsonl.gz", gzip.compress(("\n".join(lines) + "\n").encode()))
    _write(c / "cc" / "only-empty.txt", b"\n\n")  # a language without text
    (c / "dd").mkdir()  # a language folder without files
    return c


def test_skips_are_counted_and_reported(messy_corpus, tokenizer, tmp_path):
    m = preprocess(small_config(messy_corpus, tmp_path / "out", tokenizer, max_line_bytes=4096,
                                valid_fraction=0.0))
    s = m["skipped"]
    assert s["blank_lines"] == 4  # 2 in aa/a.txt, 2 in cc/only-empty.txt
    assert s["bad_utf8_lines"] == 1
    assert s["long_lines"] == 1
    assert s["bad_json_lines"] == 2
    assert s["empty_files"] == 1
    assert sorted(s["unknown_files"]) == ["README", "aa/notes.pdf"]
    assert sorted(s["empty_languages"]) == ["cc", "dd"]
    assert m["languages"]["aa"]["documents"] == 5 and m["languages"]["bb"]["documents"] == 2
    assert {sh["language"] for sh in m["shards"]} == {"aa", "bb"}


def test_tokenizer_training_skips_the_same(messy_corpus, tmp_path):
    info = train_tokenizer(messy_corpus, tmp_path / "spm", vocab_size=60, num_threads=1,
                           max_line_bytes=4096, hard_vocab_limit=False)
    assert info["skipped"]["bad_utf8_lines"] == 1 and info["skipped"]["long_lines"] == 1
    assert set(info["languages"]) == {"aa", "bb", "cc"} and info["languages"]["cc"]["sampled"] == 0


def test_missing_corpus_folder(tmp_path, tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        preprocess(small_config(tmp_path / "nope", tmp_path / "out", tokenizer))


def test_unreadable_corpus_folder(tmp_path, monkeypatch):
    (tmp_path / "c").mkdir()

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr("pathlib.Path.iterdir", denied)
    with pytest.raises(DataError, match="cannot read corpus folder"):
        discover_corpus(tmp_path / "c")


def test_only_blank_lines_is_an_error(tmp_path, tokenizer):
    _write(tmp_path / "c" / "aa" / "x.txt", b"\n  \n\n")
    with pytest.raises(DataError, match="no text"):
        train_tokenizer(tmp_path / "c", tmp_path / "spm", vocab_size=50)
    with pytest.raises(DataError, match="no documents.*blank_lines=3"):
        preprocess(small_config(tmp_path / "c", tmp_path / "out", tokenizer))


def test_corpus_without_any_text(tmp_path):
    _write(tmp_path / "c" / "aa" / "x.csv", b"a,b")
    with pytest.raises(DataError, match="no language folder"):
        discover_corpus(tmp_path / "c")


def test_bad_language_folder_name(tmp_path):
    _write(tmp_path / "c" / "en us" / "x.txt", b"hello\n")
    with pytest.raises(DataError, match="en us"):
        discover_corpus(tmp_path / "c")


def test_truncated_gzip_names_the_file(tmp_path, tokenizer):
    data = gzip.compress(("hello world, some text\n" * 2000).encode())
    _write(tmp_path / "c" / "aa" / "t.txt.gz", data[: len(data) // 2])
    with pytest.raises(DataError, match=r"t\.txt\.gz"):
        preprocess(small_config(tmp_path / "c", tmp_path / "out", tokenizer))


def test_unreadable_file_names_it(tmp_path, tokenizer, monkeypatch):
    _write(tmp_path / "c" / "aa" / "x.txt", b"hello\n")
    real_open = open

    def fake_open(path, *a, **k):
        if str(path).endswith("x.txt"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", fake_open)
    with pytest.raises(DataError, match=r"x\.txt"):
        preprocess(small_config(tmp_path / "c", tmp_path / "out", tokenizer))


def test_missing_tokenizer(tmp_path, corpus):
    with pytest.raises(DataError, match="not found"):
        preprocess(small_config(corpus, tmp_path / "out", tmp_path / "none.model"))


def test_encodings_links_and_odd_names_are_read_or_skipped(tmp_path, tokenizer):
    c = tmp_path / "c"
    lines = ["da kepuga muhebova ha votuzu.", "te rateri gavava ha liri votuzu."]
    windows = "\r\n".join(lines) + "\r\n"  # Notepad's "Unicode": UTF-16-LE, BOM, CRLF
    _write(c / "aa" / "notepad.txt", windows.encode("utf-16"))
    _write(c / "aa" / "big32.txt", codecs.BOM_UTF32_BE + windows.encode("utf-32-be"))
    _write(c / "aa" / "surrogate16.txt", codecs.BOM_UTF16_LE + "ok one\n".encode("utf-16-le")
           + b"\x00\xd8" + "lone\n".encode("utf-16-le") + "ok two\n".encode("utf-16-le"))
    _write(c / "bb" / "b.jsonl", b'{"text": "fine"}\n{"text": "bad \\ud800 escape"}\n')
    _write(c / "bb" / os.fsdecode(b"caf\xe9.txt"), b"latin-1 name\n")  # not UTF-8
    _write(tmp_path / "elsewhere" / "linked.txt", b"through a link\n")
    (c / "bb" / "sub").symlink_to(tmp_path / "elsewhere")  # followed
    (c / "bb" / "loop").symlink_to(c / "bb")  # a loop: skipped, listed
    (c / "bb" / "gone.txt").symlink_to(tmp_path / "nothing.txt")  # dangling: skipped, listed

    files, stats = discover_corpus(c)
    docs = {cf.rel: [t for _, t in iter_documents(cf, stats)] for fs in files.values()
            for cf in fs}
    assert docs == {"aa/big32.txt": lines, "aa/notepad.txt": lines,
                    "aa/surrogate16.txt": ["ok one", "ok two"], "bb/b.jsonl": ["fine"],
                    "bb/caf\\xe9.txt": ["latin-1 name"], "bb/sub/linked.txt": ["through a link"]}
    assert stats.bad_utf8_lines == 2 and sorted(stats.skipped_links) == ["bb/gone.txt", "bb/loop"]

    m = preprocess(small_config(c, tmp_path / "out", tokenizer, workers=0, valid_fraction=0.0))
    assert m["skipped"]["bad_utf8_lines"] == 2 and len(m["skipped"]["skipped_links"]) == 2
    assert m["languages"]["aa"]["documents"] == 6 and m["languages"]["bb"]["documents"] == 3


@pytest.mark.multiprocess
def test_tools_exit_2_on_bad_input(tmp_path, tokenizer):
    """docs/data.md: errors exit with code 2 and one line naming the path."""
    missing = str(tmp_path / "missing")
    for tool, args in (
        ("preprocess", ["--corpus", missing, "--tokenizer", str(tokenizer), "--out",
                        str(tmp_path / "out")]),
        ("train_tokenizer", ["--corpus", missing, "--out", str(tmp_path / "spm")]),
        ("merge_datasets", [missing, "--out", str(tmp_path / "merged")]),
    ):
        r = subprocess.run([sys.executable, f"data_tools/{tool}.py", *args],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (tool, r.stderr)
        assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
        assert missing in r.stderr


@pytest.mark.parametrize("block_bytes", [1, 7, 300])
def test_documents_do_not_depend_on_block_size_or_start_line(messy_corpus, block_bytes):
    """Blocks cut lines anywhere (in a long line, in a CRLF, in a UTF-16 character): the
    documents, their line numbers and the skip counts equal those of one block per file, and a
    start at any line gives exactly the later part."""
    c = messy_corpus
    _write(c / "aa" / "tail.txt", b"no line end\r\nlong " + b"y" * 5000)  # long, unterminated
    _write(c / "aa" / "clean.txt", b"\xef\xbb\xbfone\r\n  \r\n \xef\xbb\xbftwo\nthree")
    crlf = "\r\n".join(["one", "", "two \u00e9", "three"]) + "\r\n"
    _write(c / "bb" / "utf16.txt", crlf.encode("utf-16"))
    files, _ = discover_corpus(c)

    def read(cf, start=0, block=1 << 20):
        stats = SkipStats()
        docs = list(iter_documents(cf, stats, start, 4096, block_bytes=block))
        return docs, stats

    for cf in (cf for fs in files.values() for cf in fs):
        whole, whole_stats = read(cf)
        assert read(cf, block=block_bytes) == (whole, whole_stats), cf.rel
        for start in range(0, 12, 3):
            docs, _ = read(cf, start, block_bytes)
            assert docs == [d for d in whole if d[0] >= start], (cf.rel, start)
    tail = next(cf for cf in files["aa"] if cf.rel == "aa/tail.txt")
    assert read(tail, block=block_bytes) == ([(0, "no line end")], SkipStats(long_lines=1))
    # read across blocks, a long line is held only up to the limit + 1 bytes that mark it
    kept = [len(line) for b in iter_line_blocks(tail, 0, 4096, block_bytes)
            for line in b.data.split(b"\n")]
    assert max(kept) == 4097
    clean = next(cf for cf in files["aa"] if cf.rel == "aa/clean.txt")  # one decode per block
    assert read(clean, block=block_bytes) == ([(0, "one"), (2, "\ufefftwo"), (3, "three")],
                                              SkipStats(blank_lines=1))
    utf16 = next(cf for cf in files["bb"] if cf.rel == "bb/utf16.txt")
    assert read(utf16, block=block_bytes)[0] == [(0, "one"), (2, "two \u00e9"), (3, "three")]
