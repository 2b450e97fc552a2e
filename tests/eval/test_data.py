"""Reading classification sets (the parallel sets' reader is tested in
tests/data/test_parallel_text.py)."""

import pytest

from megatron_rembert.eval.data import EvalDataError, read_classification


def test_classification_labels_are_text(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "1", "lang": "en", "label": 1, "text": "a"}\n'
                    '{"id": "2", "lang": "de", "label": "1", "text": "b"}\n')
    out = read_classification(path, "--classify-test")
    assert [e.label for e in out.examples] == ["1", "1"] and out.languages() == ["de", "en"]
    path.write_text('{"id": "1", "lang": "en", "label": [1], "text": "a"}\n')
    with pytest.raises(EvalDataError, match=r"c.jsonl:1: field 'label'"):
        read_classification(path, "--classify-test")
