"""bench.full_scale --small (its TINY_ARGS), the CI variant of the full-scale run: the
rembert widths (H 1152, FFN 4608, E_in 256, E_out 1664) with 2 layers and a 16,000-row
vocabulary over a 1,000-piece tokenizer, at tp 2 x pp 2 on 4 processes, fp32, through train.py
and the convert CLI."""

import json

import pytest

from tests.bench import run_tiny

pytestmark = pytest.mark.multiprocess  # every test here starts processes

pytest.importorskip("transformers")


def test_full_scale_small(tmp_path):
    run = run_tiny("full_scale", tmp_path, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    r = json.loads((tmp_path / "result.json").read_text())
    # A vocabulary larger than the tokenizer's, at TP 2 (padded to 16,128 rows, not 16,000):
    # trained, saved, resumed and converted.
    assert r["layers"] == 2 and r["parameters"] == 64_966_528
    uninterrupted, resumed = r["losses"]["uninterrupted"], r["losses"]["resumed"]
    assert list(resumed) == ["3"] and resumed["3"] == uninterrupted["3"]  # bitwise
    assert r["hf"]["max_abs_diff"] <= 1e-5 * max(1.0, r["hf"]["max_abs_logit"])
    assert r["hf"]["encoder_parameters"] == r["encoder_expected"] == r["hf"]["encoder_loaded"]
    # Each rank's peak against the dry-run estimate. Loose here (at 0.2-0.5 GiB per rank the
    # allocator's slack is a large share; the full-size table in the README is the 15% check),
    # but the estimate of earlier versions (no fp32 master copy under ZeRO, no step transient)
    # read 1.8-2x and fails.
    for rank, row in r["ranks"].items():
        assert 0.8 <= row["ratio"] <= 1.6, (rank, row)
