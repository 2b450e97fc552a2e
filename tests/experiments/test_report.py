"""The experiment's table reads each run's figures where rembert-eval writes them (docs/eval.md's
schema) and shows the mean and spread over seeds; the plot is drawn from the same files."""

import statistics

import pytest

from experiments.embedding_coupling import report
from experiments.embedding_coupling.variants import SCALES, variant_model


def _pair(x):
    return {"to_en": x, "from_en": x + 0.02}


def _result(seed: int, model: float, step0: float) -> dict:
    cls_avg = {"model": {"mean": model, "std": 0.01, "runs": [model],
                         "balanced": {"mean": model / 2, "std": 0.0, "runs": [model / 2]}},
               "step0": {"mean": step0, "std": 0.0, "runs": [step0],
                         "balanced": {"mean": step0 / 2, "std": 0.0, "runs": [step0 / 2]}},
               "bag": {"accuracy": 0.3, "balanced": 0.25}, "majority": 0.32, "uniform": 1 / 7}
    retrieval = {"average": {"model": _pair(model), "step0": _pair(step0), "bag": _pair(0.2),
                             "chance": 0.002},
                 "per_layer": {"model": [{"average": _pair(model / 3)},
                                         {"average": _pair(model)}],
                               "step0": [{"average": _pair(step0)}]}}
    m = variant_model("reinvested", SCALES["cpu"])
    return {"variant": "reinvested", "seed": seed, "model": m.__dict__,
            "parameters": {"pretraining": 9_540_000, "finetuning": 5_300_000},
            "tokens": 8_192_000, "retrieval_curve_pairs": 1000,
            "metrics": {"valid": {"loss": 5.0, "loss_lang_avg": 5.1 + seed / 10},
                        "valid_curve": [[100, 6.0], [200, 5.0]],
                        "retrieval_curve": [[100, 0.01, 0.02], [200, 0.03, 0.05]]},
            "eval": {"retrieval": retrieval, "settings": {"max_pairs": 1000},
                     "classification": {"average_transfer": cls_avg}},
            "eval_centered": {"retrieval": {"average": {"model": _pair(model + 0.1),
                                                        "step0": _pair(step0),
                                                        "bag": _pair(0.3)}}}}


def test_table_shows_each_measure_as_mean_and_spread_over_seeds():
    runs = {"reinvested": [_result(1, 0.10, 0.05), _result(2, 0.14, 0.05)]}
    text = report.table(runs)
    row = next(line for line in text.splitlines() if line.startswith("| reinvested |"))
    cells = [c.strip() for c in row.strip("|").split("|")]

    def want(values):
        return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"

    assert cells[5] == want([5.2, 5.3])  # valid loss, language average
    assert cells[6] == want([0.11, 0.15])  # retrieval, both ways averaged
    assert cells[8] == want([0.21, 0.25])  # centered
    assert cells[9] == want([0.10, 0.14])  # zero-shot accuracy
    assert cells[10] == want([0.05, 0.07])  # balanced
    bag = next(line for line in text.splitlines() if line.startswith("| bag of tokens"))
    assert bag.rstrip().endswith("| 0.300 | 0.250 |")
    chance = next(line for line in text.splitlines() if line.startswith("| chance"))
    assert chance.rstrip().endswith("| 0.320 | 0.143 |")


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    runs = {"reinvested": [_result(1, 0.10, 0.05), _result(2, 0.14, 0.05)]}
    out = tmp_path / "fig.png"
    report.plot(runs, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
