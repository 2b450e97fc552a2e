"""Reading evaluation sets: both formats, the duplicate rule, the deterministic subset."""

import json

import pytest

from megatron_rembert.eval.data import EvalDataError, read_classification, read_parallel, subset


def test_jsonl_and_tsv_read_alike_and_duplicates_are_dropped(tmp_path):
    rows = [("Hallo Welt", "hello world"), ("Guten Tag", "good day"),
            ("Hallo Welt", "hi world"),  # the language side repeats: dropped
            ("Servus", "good day"),  # the English side repeats: dropped
            ("ok", "ok")]  # identical sides: kept, counted
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "de.jsonl").write_text("".join(
        json.dumps({"id": str(i), "text": t, "en": e, "label": "x"}) + "\n"
        for i, (t, e) in enumerate(rows)))
    (tmp_path / "b" / "de.tsv").write_text("".join(f"{t}\t{e}\n\n" for t, e in rows))
    for folder in ("a", "b"):
        (pset,) = read_parallel(tmp_path / folder, max_pairs=100)
        assert pset.lang == "de" and pset.read == 5 and pset.duplicates_dropped == 2
        assert pset.texts == ["Hallo Welt", "Guten Tag", "ok"]
        assert pset.english == ["hello world", "good day", "ok"]
        assert pset.identical_pairs == 1


def test_subset_is_deterministic_sorted_and_per_language():
    a = subset(1000, 50, 0, "de")
    assert list(a) == sorted(set(a.tolist())) and len(a) == 50
    assert list(a) == list(subset(1000, 50, 0, "de"))
    assert list(a) != list(subset(1000, 50, 0, "fr"))
    assert list(subset(30, 50, 0, "de")) == list(range(30))


def test_max_pairs_keeps_aligned_pairs(tmp_path):
    (tmp_path / "fr.tsv").write_text("".join(f"t{i}\te{i}\n" for i in range(40)))
    (pset,) = read_parallel(tmp_path, max_pairs=10)
    assert len(pset) == 10
    assert all(t[1:] == e[1:] for t, e in zip(pset.texts, pset.english, strict=True))


def test_classification_labels_are_text(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "1", "lang": "en", "label": 1, "text": "a"}\n'
                    '{"id": "2", "lang": "de", "label": "1", "text": "b"}\n')
    out = read_classification(path, "--classify-test")
    assert [e.label for e in out.examples] == ["1", "1"] and out.languages() == ["de", "en"]
    path.write_text('{"id": "1", "lang": "en", "label": [1], "text": "a"}\n')
    with pytest.raises(EvalDataError, match=r"c.jsonl:1: field 'label'"):
        read_classification(path, "--classify-test")
