"""Schedules of the mask rate and the language mix: the default is today's stream bit for bit;
a scheduled stream stays a pure function of (seed, index, schedule), keeps its epochs across
segment boundaries and does not depend on the layout; the validation set is layout-free."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_rembert.data.config import DataConfig
from megatron_rembert.data.loader import build_pretraining_loader, build_validation_set
from megatron_rembert.data.masking import MaskingConfig, mask_batch
from megatron_rembert.data.sampler import MultilingualSampler, ScheduledSampler
from megatron_rembert.data.schedule import DataPlan, Schedule
from megatron_rembert.parallel.layout import Layout

ROWS, TOKENS = [50, 7, 300], [5000, 700, 30000]


def test_one_segment_is_the_unscheduled_stream():
    idx = np.arange(3 * 4096 + 17)
    old = MultilingualSampler(ROWS, TOKENS, alpha=0.5, seed=3)(idx)
    new = ScheduledSampler(ROWS, TOKENS, [(0, 0.5, None)], seed=3)(idx)
    for a, b in zip(old, new, strict=True):
        np.testing.assert_array_equal(a, b)


def test_mask_probs_default_is_the_config_rate():
    ids = np.random.default_rng(0).integers(5, 100, size=(4, 32))
    cfg = MaskingConfig(vocab_size=100, max_predictions=16, seed=1, mask_prob=0.2)
    idx = np.arange(10, 14)
    plain, scheduled = mask_batch(ids, idx, cfg), mask_batch(ids, idx, cfg, mask_probs=[0.2] * 4)
    for key in plain:
        np.testing.assert_array_equal(plain[key], scheduled[key])
    more = mask_batch(ids, idx, cfg, mask_probs=[0.4] * 4)
    assert more["masked_weights"].sum() > plain["masked_weights"].sum()


def test_schedule_functions():
    data = DataConfig(phase_starts=[0.0, 0.5, 0.9], phase_alpha=[0.7, 0.5, 0.3],
                      phase_mask_prob=[0.3, 0.15, 0.05], mask_schedule="linear",
                      language_start={"c": 0.25})
    s = Schedule(data, 100)
    assert [(p.first_step, p.end_step) for p in s.phases] == [(0, 50), (50, 90), (90, 100)]
    assert s.mask_prob(0) == 0.3 and s.mask_prob(25) == pytest.approx(0.225)
    assert s.mask_prob(95) == 0.05 and s.max_mask_prob == 0.3
    assert s.phase(49).alpha == 0.7 and s.phase(50).alpha == 0.5
    assert [(c, a, act) for c, a, act in s.segments(["a", "b", "c"])] == [
        (0, 0.7, [True, True, False]), (25, 0.7, [True, True, True]),
        (50, 0.5, [True, True, True]), (90, 0.3, [True, True, True])]
    step = Schedule(DataConfig(phase_starts=[0.0, 0.5], phase_mask_prob=[0.3, 0.1]), 10)
    assert [step.mask_prob(i) for i in (0, 4, 5, 9)] == [0.3, 0.3, 0.1, 0.1]


def test_scheduled_stream_is_pure_and_keeps_epochs_across_segments():
    G = 64
    segments = [(0, 1.0, [True, True, False]), (5 * G, 0.3, [True, True, True]),
                (9 * G, 0.0, [True, True, True])]
    a = ScheduledSampler(ROWS, TOKENS, segments, seed=5)
    idx = np.arange(40 * G)
    lang, row = a(idx)
    b = ScheduledSampler(ROWS, TOKENS, segments, seed=5)  # fresh, asked backwards in pieces
    rev = idx[::-1].copy()
    parts = [b(rev[i:i + 333]) for i in range(0, len(rev), 333)]
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts])[::-1], lang)
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts])[::-1], row)
    assert not (lang[:5 * G] == 2).any() and (lang[5 * G:] == 2).any()  # late entry
    # alpha 0 (uniform) in the last segment: each language about a third
    np.testing.assert_allclose(np.bincount(lang[9 * G:], minlength=3) / (31 * G), 1 / 3,
                               atol=0.02)
    for lng, n_rows in enumerate(ROWS):
        mine = row[lang == lng]
        for e in range(min(len(mine) // n_rows, 4)):  # epochs run on across segments
            assert sorted(mine[e * n_rows:(e + 1) * n_rows]) == list(range(n_rows))


SCHEDULED = dict(seq_length=64, phase_starts=[0.0, 0.5], phase_alpha=[1.0, 0.0],
                 phase_mask_prob=[0.3, 0.1], mask_schedule="linear")


def _steps(data_dir, micro, dp_rank, dp, steps, start=0):
    data = DataConfig(path=str(data_dir), **SCHEDULED)
    layout = Layout.build(dp, dp_rank, micro_batch_size=micro, global_batch_size=8)
    loader = build_pretraining_loader(data, layout, DataPlan.resolve(data, steps, 0.15), seed=2,
                                      num_workers=0, return_tensors="np",
                                      num_micro_batches=(steps - start) * layout.gas,
                                      consumed_samples=8 * start)
    batches = list(loader)
    return [{k: np.concatenate([b[k] for b in batches[i * layout.gas:(i + 1) * layout.gas]])
             for k in batches[0] if k != "unpadded"}  # a flag per micro-batch, not per row
            for i in range(steps - start)]


def test_steps_do_not_depend_on_layout_or_resume(dataset):
    """The masks and samples of each step under a schedule: one process in one micro-batch,
    two ranks in micro-batches of 2, and a resume at step 2, across the boundary at step 2."""
    one = _steps(dataset, 8, 0, 1, 4)
    two = [_steps(dataset, 2, r, 2, 4) for r in range(2)]
    resumed = _steps(dataset, 8, 0, 1, 4, start=2)
    for s in range(4):
        for key in one[s]:
            np.testing.assert_array_equal(
                one[s][key], np.concatenate([two[0][s][key], two[1][s][key]]), err_msg=key)
            if s >= 2:
                np.testing.assert_array_equal(one[s][key], resumed[s - 2][key], err_msg=key)
    # the rate falls from 0.3 over phase 0 and is 0.1 from step 2: fewer masked tokens
    masked = [float(b["masked_weights"].sum()) for b in one]
    assert masked[0] > masked[2] and masked[1] > masked[3]


def test_validation_set_is_stratified_and_layout_free(dataset):
    data = DataConfig(path=str(dataset), seq_length=64)
    sets = {}
    for micro, dp in ((8, 1), (2, 2), (1, 4)):
        per_rank = [build_validation_set(data, Layout.build(dp, r, micro_batch_size=micro,
                                                            global_batch_size=8),
                                         DataPlan.resolve(data, 1, 0.15), seed=3,
                                         per_language=5)
                    for r in range(dp)]
        seen = {}
        for lang, name in enumerate(per_rank[0].languages):
            real = [(b["input_ids"][i].tobytes(), b["masked_positions"][i].tobytes())
                    for v in per_rank for b in v.batches(lang, "np")
                    for i in np.flatnonzero(b["masked_weights"].sum(1) > 0)]
            seen[name] = sorted(real)
        sets[(micro, dp)] = seen
    first = sets[(8, 1)]
    assert all(s == first for s in sets.values())
    counts = build_validation_set(data, Layout(micro_batch_size=8),
                                  DataPlan.resolve(data, 1, 0.15), seed=3,
                                  per_language=5).dataset.rows_per_language
    assert {k: len(v) for k, v in first.items()} == {k: min(5, counts[k]) for k in first}


def test_sampling_report_by_phase(dataset, tmp_path):
    from megatron_rembert.data.common import DataError
    from megatron_rembert.prep.inspection import config_sampling_table

    config = tmp_path / "run.yaml"
    config.write_text("data: {phase_starts: [0.0, 0.5], phase_alpha: [1.0, 0.0], "
                      "language_start: {hang: 0.75}}\ntrain: {steps: 100}\n")
    lines = config_sampling_table(dataset, config).splitlines()
    assert "phase 0 step 0 alpha 1" in lines[1] and "phase 1 step 75 alpha 0" in lines[1]
    table = {line.split()[0]: line.split()[1:] for line in lines[3:]}
    # columns: share; steps 0 (alpha 1), 50 (alpha 0), 75 (alpha 0, hang entered)
    assert len(table) == 8 and table["hang"][1:] == ["0.0%", "0.0%", "12.5%"]
    share = float(table["latn_a"][0][:-1])  # alpha 1: the token share, without hang's
    assert float(table["latn_a"][1][:-1]) == pytest.approx(
        share / (1 - float(table["hang"][0][:-1]) / 100), abs=0.1)
    assert table["latn_a"][2:] == ["14.3%", "12.5%"]  # uniform over 7, then 8
    config.write_text("data: {language_start: {sw: 0.5}}\n")
    with pytest.raises(DataError, match=r"names \['sw'\], which the dataset does not have"):
        config_sampling_table(dataset, config)
