"""The parallel set (eval.retrieval_path, rembert-eval --parallel), its one reader: both
formats read alike, the duplicate rule, the fixed subset, and every bad folder, file, line or
setting refused at start-up by train.py (--dry-run included) with one `error:` line naming the
file and line or the key, exit 2."""

import json
from pathlib import Path

import pytest

from megatron_rembert.data.common import DataError
from megatron_rembert.data.parallel_text import read_parallel_set, subset
from megatron_rembert.train import main as train_main

ROOT = Path(__file__).resolve().parents[2]


def _write(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def _jsonl(*pairs, **extra) -> str:
    return "".join(json.dumps({"id": str(i), "text": t, "en": e, **extra}) + "\n"
                   for i, (t, e) in enumerate(pairs))


def _pairs(sets) -> dict[str, list[tuple[str, str]]]:
    return {p.lang: list(zip(p.texts, p.english, strict=True)) for p in sets}


def test_reads_jsonl_and_tsv_per_language(tmp_path):
    folder = _write(tmp_path / "set", {
        "de.jsonl": _jsonl(("Hallo Welt", "Hello world"), ("Guten Tag", "Good day"),
                           ("Danke", "Thanks"), source="x") + "\n",
        "ja.tsv": "こんにちは\tHello\r\n\nありがとう\tThank you\n",
        "notes.txt": "ignored", "README.md": "ignored"})
    (folder / "sub.jsonl").mkdir()  # a folder is not a language file
    got = read_parallel_set(folder, max_pairs=10)
    assert [p.file.name for p in got] == ["de.jsonl", "ja.tsv"]
    assert _pairs(got) == {
        "de": [("Hallo Welt", "Hello world"), ("Guten Tag", "Good day"), ("Danke", "Thanks")],
        "ja": [("こんにちは", "Hello"), ("ありがとう", "Thank you")]}


def test_jsonl_and_tsv_read_alike_and_duplicates_are_dropped(tmp_path):
    rows = [("Hallo Welt", "hello world"), ("Guten Tag", "good day"),
            ("Hallo Welt", "hi world"),  # the language side repeats: dropped
            ("Servus", "good day"),  # the English side repeats: dropped
            ("ok", "ok")]  # identical sides: kept, counted
    _write(tmp_path / "a", {"de.jsonl": _jsonl(*rows, label="x")})
    _write(tmp_path / "b", {"de.tsv": "".join(f"{t}\t{e}\n\n" for t, e in rows)})
    for folder in ("a", "b"):
        (pset,) = read_parallel_set(tmp_path / folder, max_pairs=100)
        assert pset.lang == "de" and pset.read == 5 and pset.duplicates_dropped == 2
        assert pset.texts == ["Hallo Welt", "Guten Tag", "ok"]
        assert pset.english == ["hello world", "good day", "ok"]
        assert pset.identical_pairs == 1


def test_subset_is_deterministic_sorted_and_per_language():
    a = subset(1000, 50, "de")
    assert list(a) == sorted(set(a.tolist())) and len(a) == 50
    assert list(a) == list(subset(1000, 50, "de"))
    assert list(a) != list(subset(1000, 50, "fr"))
    assert list(subset(30, 50, "de")) == list(range(30))


def test_max_pairs_takes_the_subset_after_duplicates_keeping_pairs_aligned(tmp_path):
    # 40 distinct pairs, each written twice: the subset is drawn among the 40 distinct ones
    rows = [(f"t{i}", f"e{i}") for i in range(40)]
    _write(tmp_path, {"fr.tsv": "".join(f"{t}\t{e}\n" for t, e in rows + rows)})
    (pset,) = read_parallel_set(tmp_path, max_pairs=10)
    assert len(pset) == 10 and pset.read == 80 and pset.duplicates_dropped == 40
    assert pset.texts == [rows[i][0] for i in subset(40, 10, "fr")]
    assert pset.texts != [t for t, _ in rows[:10]]  # a random subset, not the first lines
    assert all(t[1:] == e[1:] for t, e in zip(pset.texts, pset.english, strict=True))


@pytest.mark.parametrize("files, message", [
    ({}, r"eval.retrieval_path=.*: no <lang>.jsonl or <lang>.tsv files"),
    ({"de.jsonl": "", "x.txt": "a"}, r"de.jsonl: no pairs \(an empty file\)"),
    ({"de.jsonl": _jsonl(("a", "b")) + "{not json\n"}, r"de.jsonl:2: not a JSON object \("),
    ({"de.jsonl": "[1, 2]\n"}, r"de.jsonl:1: expected a JSON object"),
    ({"de.jsonl": '{"text": "a"}\n'}, r"de.jsonl:1: missing field 'en'"),
    ({"de.jsonl": '{"text": 3, "en": "b"}\n'},
     r"de.jsonl:1: field 'text' must be a string, got int"),
    ({"de.jsonl": '{"text": " ", "en": "b"}\n'}, r"de.jsonl:1: field 'text' is empty"),
    ({"de.tsv": "a\tb\nonly one field\n"}, r"de.tsv:2: expected <text> TAB <English"),
    ({"de.tsv": "a\tb\tc\n"}, r"de.tsv:1: .* found 3 tab-separated fields"),
    ({"de.tsv": "a\t \n"}, r"de.tsv:1: field 'en' is empty"),
    ({"de.jsonl": _jsonl(("a", "b")), "de.tsv": "a\tb\n"}, r"de.jsonl and de.tsv both"),
])
def test_bad_files_name_the_file_and_line(tmp_path, files, message):
    folder = _write(tmp_path / "set", files)
    with pytest.raises(DataError, match=message):
        read_parallel_set(folder, max_pairs=5)


def test_not_utf8_and_missing_folder(tmp_path):
    folder = _write(tmp_path / "set", {})
    (folder / "de.tsv").write_bytes(b"a\tb\ncaf\xe9\tcafe\n")
    with pytest.raises(DataError, match=r"de.tsv:2: not UTF-8"):
        read_parallel_set(folder, 5)
    with pytest.raises(DataError, match=r"eval.retrieval_path=.*nope: no such folder"):
        read_parallel_set(tmp_path / "nope", 5)
    with pytest.raises(DataError, match=r"^--parallel x: no such folder"):
        read_parallel_set(tmp_path / "nope", 5, "--parallel x")


@pytest.fixture
def good_set(tmp_path) -> Path:
    return _write(tmp_path / "good", {"de.jsonl": _jsonl(("a b", "c d"), ("e f", "g h"))})


@pytest.mark.parametrize("sets, names", [
    (["eval.retrieval_path={bad}"], "bad/de.jsonl:1"),
    (["eval.retrieval_path={tmp}/nope"], "eval.retrieval_path={tmp}/nope"),
    (["eval.retrieval_path={good}", "parallel.pp=2"], "parallel.pp=2"),
    (["eval.retrieval_path={good}", "data.tokenizer="], "needs data.tokenizer"),
    (["eval.retrieval_path={good}", "train.eval_interval=0"], "train.eval_interval=0"),
    (["eval.retrieval_path={good}", "eval.retrieval_layer=3"], "eval.retrieval_layer=3"),
    (["eval.retrieval_path={good}", "eval.retrieval_pairs=1"], "eval.retrieval_pairs"),
])
def test_train_py_refuses_at_start_up(tmp_path, good_set, capsys, monkeypatch, sets, names):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    _write(tmp_path / "bad", {"de.jsonl": "{oops\n"})
    fill = {"tmp": str(tmp_path), "good": str(good_set), "bad": str(tmp_path / "bad")}
    argv = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--dry-run",
            "--set", f"train.save_dir={tmp_path}/ckpt", "--set", f"train.log_dir={tmp_path}/logs"]
    for item in sets:
        argv += ["--set", item.format(**fill)]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert names.format(**fill) in lines[0], err


def test_a_good_set_passes_the_start_up_checks(tmp_path, good_set):
    from megatron_rembert.run_config.checks import check_settings
    from megatron_rembert.run_config.load import load_config

    config = load_config(ROOT / "configs" / "tiny.yaml", [
        f"train.save_dir={tmp_path}/ckpt", f"train.log_dir={tmp_path}/logs",
        f"eval.retrieval_path={good_set}"])
    check_settings(config)  # raises on any problem
