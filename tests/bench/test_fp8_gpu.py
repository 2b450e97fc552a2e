"""bench.fp8_gpu's parts on CPU at small sizes (the fp8 GEMMs run on CPU too): its GEMM
check passes on the fp8 layers and FAILS when they are not in fp8, its step runs the fp8 GEMMs
only when asked, the demo loss curves come out for both, and without a GPU it says so. The GPU
run itself cannot happen here."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from bench import fp8_gpu, gpu_table
from megatron_rembert.kernels import fp8 as fp8_kernels
from megatron_rembert.run_config.load import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench() -> ModuleType:
    return fp8_gpu


def test_demo_model_is_the_demo_configs(bench):
    assert bench.DEMO_MODEL == load_config(ROOT / "configs" / "demo.yaml").model
    demo = load_config(ROOT / "configs" / "demo.yaml")
    assert (bench.DEMO_SEQ, bench.DEMO_LR, bench.DEMO_WARMUP) == (
        demo.data.seq_length, demo.optim.lr, demo.optim.warmup_steps)
    assert bench.DEMO_BATCH == demo.train.global_batch_size


def test_gemm_check_passes_on_fp8_and_fails_without_it(bench, monkeypatch):
    sizes = dict(tokens=40, hidden=64, ffn=128)
    assert bench.check_gemms("cpu", **sizes) == []
    monkeypatch.setattr(bench, "enable_fp8", lambda layers: None)  # bf16 GEMMs instead
    assert len(bench.check_gemms("cpu", **sizes)) == 9  # y, dx, dW of 3 layers


@pytest.mark.parametrize("fp8", [False, True])
def test_model_step_runs_the_fp8_gemms_only_when_asked(bench, monkeypatch, fp8):
    calls = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def each_step_once(step, batches, sync):
        for batch in batches:
            step(batch)
        return 1.0  # seconds per step: not measured here

    monkeypatch.setattr(fp8_kernels, "_gemm", lambda device: spy)
    monkeypatch.setattr(bench, "timed", each_step_once)
    config = bench.DEMO_MODEL.replace(num_hidden_layers=1)
    result = bench.model_step(config, 2, 16, 1, torch.device("cpu"), fp8, lambda: None)
    # 2 steps x 6 linears x 3 GEMMs
    assert len(calls) == (36 if fp8 else 0)
    assert result["tokens_per_s"] == 32 and result["tflops"] > 0


def test_loss_curves_of_bf16_and_fp8(bench):
    """A short demo curve on CPU, in bf16 and in fp8: close, and not the same."""
    curves = [bench.loss_curve(bench.DEMO_MODEL, 20, 8, 32, torch.device("cpu"), fp8, lr=3e-3,
                               warmup=5) for fp8 in (False, True)]
    assert len(curves[0]) == len(curves[1]) == 20
    assert bench.compare_curves(*curves, tolerance=0.05) == []
    assert curves[0] != curves[1]


def test_curve_comparison_fails_outside_the_tolerance(bench, capsys):
    assert bench.compare_curves([5.0, 4.0], [5.0, 4.3], tolerance=0.05) == ["loss curve"]
    assert "FAILED" in capsys.readouterr().out
    assert bench.compare_curves([5.0, 4.0], [5.0, 4.1], tolerance=0.05) == []


def test_synthetic_rows_repeat_a_block_of_one_topic(bench):
    batch = bench.synthetic_batch(bench.DEMO_MODEL, 3, 64, 0, "cpu")
    positions, labels = batch["masked_positions"], batch["masked_labels"]
    ids = batch["input_ids"].scatter(1, positions, labels)  # the unmasked rows
    assert torch.equal(ids[:, :16].repeat(1, 4), ids)
    topics = (ids - 5) // bench.TOPIC_SIZE
    assert bool((topics == topics[:, :1]).all()) and int(ids.max()) < 1000
    assert bool((batch["input_ids"].gather(1, positions) == 4).all())
    assert torch.equal(bench.synthetic_batch(bench.DEMO_MODEL, 3, 64, 0, "cpu")["input_ids"],
                       batch["input_ids"])  # a pure function of the step


def test_help_and_no_gpu_message(bench, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--help"])
    assert exit_.value.code == 0 and "--curve-steps" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        bench.main([])
    assert str(exit_.value.code).startswith("error: bench.fp8_gpu needs a CUDA GPU")


def test_table_figures_are_what_the_gpu_table_reads(bench):
    results = {False: {"tokens_per_s": 100.0, "tflops": 400.0},
               True: {"tokens_per_s": 130.0, "tflops": 520.0}}
    figures = bench.table_figures(results, 989e12, [[7.0, 4.0], [7.0, 4.2]])
    assert figures.keys() == gpu_table.SCHEMA["fp8"]
    assert figures["fp8_over_bf16"] == pytest.approx(1.3)
    assert figures["loss_ratio"] == pytest.approx(1.05)
