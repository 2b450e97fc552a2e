"""rembert-libreoffice-corpus's outputs on the packages of tests/data/libreoffice_debs.py:
alignment, what each language keeps, the split by page, the topic sets, the summary,
determinism, and that prep/corpus.py reads the corpus. Expected values come from the
fixture's plain texts, never from the code under test."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rembert.prep.corpus import SkipStats, discover_corpus, iter_documents
from megatron_rembert.prep.libreoffice import LibreOfficeConfig, build_libreoffice_corpus
from tests.data.libreoffice_debs import (
    COMMON,
    FRACTION,
    HELD,
    MAX_TRAIN,
    MIN_TRAIN,
    MODULES,
    PAGES,
    SEED,
    SPEC,
    deb_name,
    expected_kept,
    unit,
    write_debs,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def debs(tmp_path_factory) -> Path:
    return write_debs(tmp_path_factory.mktemp("debs"))


def build(debs: Path, out: Path, **kw) -> dict:
    cfg = dict(eval_fraction=FRACTION, seed=SEED, topic_min_train=MIN_TRAIN,
               topic_max_train=MAX_TRAIN)
    cfg.update(kw)
    return build_libreoffice_corpus(LibreOfficeConfig(str(debs), str(out), **cfg))


@pytest.fixture(scope="module")
def out(debs, tmp_path_factory) -> Path:
    o = tmp_path_factory.mktemp("lo") / "out"
    build(debs, o)
    return o


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_parallel_pairs_align_by_page_and_id(out):
    for lang in ("de", "pt-br"):
        want, seen_en, seen_text = [], set(), set()
        for path, rows in expected_kept(lang).items():
            if path in HELD:
                want += [{"id": f"{path}#{k}", "label": path.split("/")[0], "text": t, "en": en}
                         for k, t, en in rows]
        want.sort(key=lambda r: r["id"])
        deduped = []
        for r in want:  # a text already seen, English or not: only its first id stays
            if r["en"] not in seen_en and r["text"] not in seen_text:
                seen_en.add(r["en"])
                seen_text.add(r["text"])
                deduped.append(r)
        got = read_jsonl(out / "eval" / "parallel" / f"{lang}.jsonl")
        assert got == deduped
        assert sum(r["en"] == COMMON for r in got) == 1
        assert sum(r["text"] == "五段" for r in got) == (lang == "pt-br")
        assert not [r for r in got if "repeated id" in r["en"]]  # ambiguous: dropped
    assert not (out / "eval" / "parallel" / "en.jsonl").exists()


def test_corpus_documents_and_untranslated_dropped_from_that_language_only(out):
    for lang, code in (("en-us", "en"), ("de", "de"), ("pt-br", "pt-br")):
        kept = expected_kept(lang)  # in each language's own page order
        want = [" ".join(t for _, t, _ in kept[p]) for p in sorted(kept) if p not in HELD]
        assert (out / "corpus" / code / "help.txt").read_text(encoding="utf-8") == \
            "".join(f"{doc}\n" for doc in want)
    de = (out / "corpus" / "de" / "help.txt").read_text(encoding="utf-8")
    pt = (out / "corpus" / "pt-br" / "help.txt").read_text(encoding="utf-8")
    third = [p for p in PAGES if p not in HELD][0] + ": a third paragraph with more words."
    assert third not in de and f"[pt-br] {third}" in pt  # untranslated in de only
    assert "not found]" not in pt and "Short." not in de + pt and "五段" in pt
    assert "Tom & Jerry <b> in Zürich" in de  # markup stripped, entities unescaped


def test_no_held_out_text_reaches_the_corpus_in_any_language(out):
    corpus = "".join(p.read_text(encoding="utf-8") for p in (out / "corpus").rglob("*.txt"))
    held_texts = {t for lang in SPEC for p in HELD for _, t in SPEC[lang][p]
                  if not t.endswith(COMMON) and len(t) >= 20}  # COMMON is on every page
    assert held_texts and not [t for t in held_texts if t in corpus]


def test_topic_sets(out):
    train = read_jsonl(out / "eval" / "topic" / "train.jsonl")
    test = read_jsonl(out / "eval" / "topic" / "test.jsonl")
    page = lambda row: row["id"].split("#")[0]  # noqa: E731
    train_half = {p for p in HELD if unit("topic", SEED, p) < 0.5}
    assert {page(r) for r in train} <= train_half
    assert {page(r) for r in test} <= HELD - train_half  # disjoint by page
    assert {r["lang"] for r in train} == {"en"}
    assert {r["lang"] for r in test} == {"en", "de", "pt-br"}
    en_kept, candidates, seen = expected_kept("en-us"), {}, set()
    for p in sorted(train_half):  # English texts of train-half pages, each text once
        for _, t, _ in en_kept[p]:
            if t not in seen:
                seen.add(t)
                candidates.setdefault(p.split("/")[0], []).append(t)
    for label in MODULES:
        rows = [r for r in train if r["label"] == label]
        assert len(rows) == min(MAX_TRAIN, len(candidates[label]))
        assert {r["text"] for r in rows} <= set(candidates[label])
    assert not [r for r in test if r["text"].endswith(COMMON)]  # its English text is in train
    for r in test:
        key = r["id"].split("#")[1]
        assert (key, r["text"]) in [(k, t) for k, t, _ in expected_kept(
            {"en": "en-us"}.get(r["lang"], r["lang"]))[page(r)]]


def test_summary_counts(out, debs):
    s = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    de, pt, en = s["languages"]["de"], s["languages"]["pt-br"], s["languages"]["en"]
    n = sum(len(SPEC["en-us"][p]) for p in PAGES)
    assert en["repeated_ids"] == 2 * 4 + 4  # 4 pages of each kind: 2 ambiguous, 1 repeat
    assert en["paragraphs"] == en["aligned"] == n - 12 and en["too_short"] == len(PAGES)
    assert de["untranslated"] == len(PAGES)  # the third paragraph of every page
    assert pt["pages_skipped"] == {"malformed: unclosed paragraph": 1}
    assert pt["pages"] == len(PAGES) - 1
    assert pt["aligned"] == pt["paragraphs"] - (len(PAGES) - 1)  # the extra paragraphs
    assert pt["broken_embed"] == 4
    for lang, c in s["languages"].items():
        kept = expected_kept({"en": "en-us"}.get(lang, lang))
        assert c["kept"] == sum(map(len, kept.values()))
        assert c["eval_paragraphs"] == sum(len(kept[p]) for p in HELD if p in kept)
    assert s["inputs"]["de"] == {"package": deb_name("de"), "sha256": hashlib.sha256(
        (debs / deb_name("de")).read_bytes()).hexdigest()}
    assert s["held_out"]["sha256"] == hashlib.sha256(
        "".join(f"{p}\n" for p in sorted(HELD)).encode()).hexdigest()


def test_deterministic_and_rerun_replaces_the_output(debs, out, tmp_path):
    again = tmp_path / "again"
    build(debs, again)
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((out / f).read_bytes() == (again / f).read_bytes() for f in files)
    build(debs, again, languages=("de",))  # a rerun with fewer languages: pt-br's files go
    assert not (again / "corpus" / "pt-br").exists()
    assert not (again / "eval" / "parallel" / "pt-br.jsonl").exists()
    assert (again / "corpus" / "de" / "help.txt").read_bytes() == \
        (out / "corpus" / "de" / "help.txt").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]  # nothing else written


def test_prep_corpus_reads_the_output(out):
    files, stats = discover_corpus(out / "corpus")
    assert sorted(files) == ["de", "en", "pt-br"]
    docs = [t for _, t in iter_documents(files["de"][0], stats)]
    assert docs == (out / "corpus" / "de" / "help.txt").read_text(encoding="utf-8").splitlines()
    assert stats.to_dict() == SkipStats().to_dict()


@pytest.mark.multiprocess
def test_the_checkout_script_runs(debs, tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "data_tools" / "make_libreoffice_corpus.py"),
                           "--debs", str(debs), "--out", str(tmp_path / "o"),
                           "--eval-fraction", "0.5", "--seed", str(SEED)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pt-br" in done.stdout and (tmp_path / "o" / "summary.json").exists()
