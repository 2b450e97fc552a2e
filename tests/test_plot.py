"""python -m megatron_rembert.plot: the curves drawn are the rows of metrics.jsonl (a resumed
run's repeated steps: the later row), per language for validation; bad input is one line."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from megatron_rembert.plot import main, plot_runs  # noqa: E402


def _write(log_dir, rows, tail=""):
    log_dir.mkdir(parents=True)
    (log_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def _valid(step, en, sw):
    return {"split": "valid", "step": step, "loss": (en + sw) / 2, "mlm_acc": 0.5,
            "languages": {"en": {"loss": en, "mlm_acc": 0.6}, "sw": {"loss": sw, "mlm_acc": 0.4}}}


def test_curves_follow_the_rows(tmp_path, capsys):
    a, b = tmp_path / "coupled", tmp_path / "decoupled"
    _write(a, [{"split": "train", "step": s, "loss": 10.0 - s, "mlm_acc": 0.1 * s}
               for s in (1, 2, 3)]
           + [{"split": "train", "step": 3, "loss": 6.5, "mlm_acc": 0.3},  # redone after resume
              _valid(2, 7.0, 9.0), _valid(4, 6.0, 8.0)],
           tail='{"split": "train", "st')  # a last line cut off by a crash
    _write(b, [{"split": "train", "step": 1, "loss": 9.0, "mlm_acc": 0.2}, _valid(2, 5.0, 6.0)])
    fig = plot_runs([a, b])
    train_loss, _, valid_loss, _ = fig.axes
    (run_a, run_b) = [line.get_xydata().tolist() for line in train_loss.get_lines()]
    assert run_a == [[1, 9.0], [2, 8.0], [3, 6.5]] and run_b == [[1, 9.0]]
    lines = [line.get_xydata().tolist() for line in valid_loss.get_lines()]
    assert lines == [[[2, 8.0], [4, 7.0]], [[2, 7.0], [4, 6.0]], [[2, 9.0], [4, 8.0]],
                     [[2, 5.5]], [[2, 5.0]], [[2, 6.0]]]
    assert [t.get_text() for t in train_loss.get_legend().get_texts()] == ["coupled",
                                                                          "decoupled"]
    out = tmp_path / "runs.png"
    assert main([str(a), str(b), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "missing"), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "missing/metrics.jsonl" in err
    _write(tmp_path / "bad", [{"split": "train", "step": 1, "loss": 1.0}], tail="oops\n\n")
    (tmp_path / "bad" / "metrics.jsonl").write_text("oops\n" + json.dumps(
        {"split": "train", "step": 1, "loss": 1.0}) + "\n")
    assert main([str(tmp_path / "bad"), "--out", str(tmp_path / "x.png")]) == 2
    assert "metrics.jsonl:1: not a metrics row" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_retrieval_panels_where_a_run_measured_it(tmp_path):
    a, b = tmp_path / "with", tmp_path / "without"
    rows = []
    for step, (de, ja) in ((2, (0.1, 0.3)), (4, (0.5, 0.7))):
        row = _valid(step, 7.0, 9.0)
        row["languages"]["de"] = {"retrieval_to_en": de, "retrieval_from_en": de / 2}
        row["languages"]["ja"] = {"retrieval_to_en": ja, "retrieval_from_en": ja / 2}
        row.update(retrieval_to_en=(de + ja) / 2, retrieval_from_en=(de + ja) / 4)
        rows.append(row)
    _write(a, rows)
    _write(b, [_valid(2, 5.0, 6.0)])
    assert len(plot_runs([b]).axes) == 4  # no retrieval logged: the four panels only
    fig = plot_runs([a, b])
    to_en, from_en = fig.axes[4:]
    assert [line.get_xydata().tolist() for line in to_en.get_lines()] == [
        [[2, 0.2], [4, 0.6]], [[2, 0.1], [4, 0.5]], [[2, 0.3], [4, 0.7]]]
    assert from_en.get_lines()[0].get_xydata().tolist() == [[2, 0.1], [4, 0.3]]
    assert "English" in to_en.get_title()
