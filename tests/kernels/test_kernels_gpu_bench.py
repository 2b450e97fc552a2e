"""The correctness checks of bench.kernels_gpu, run on CPU (Triton interpreter) at small
sizes: they pass on the kernels and FAIL on a wrong result, so that the GPU run's exit status
means something. The GPU run itself cannot happen here."""

from __future__ import annotations

import argparse
from types import ModuleType
from typing import Any

import pytest
import torch

from bench import common, gpu_table, kernels_gpu


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setattr(kernels_gpu, "DEVICE", "cpu")
    monkeypatch.setattr(kernels_gpu, "BACKEND", "triton")  # TRITON_INTERPRET is set by conftest
    return kernels_gpu


def run_checks(bench: ModuleType, dtype: torch.dtype) -> Any:  # noqa: ANN401 - bench.Checks
    """The bench's softmax and loss checks at CPU-sized shapes."""
    checks = bench.Checks()
    bench.check_softmax(dtype, checks, shapes=[(2, 2, 33)])
    bench.check_loss(dtype, 37, 4133, 4100, 16, 0.25, checks)  # rows of 2 column tiles
    return checks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checks_pass_on_the_kernels(bench: ModuleType, dtype: torch.dtype) -> None:
    checks = run_checks(bench, dtype)
    assert checks.total == 6 and checks.failed == []


def test_checks_fail_on_a_wrong_result(bench: ModuleType, monkeypatch: pytest.MonkeyPatch
                                       ) -> None:
    real = bench.linear_cross_entropy

    def off_by_one(h, w, b, tgt, wts, *, n_valid, backend, **kw):  # noqa: ANN001, ANN202
        if backend == "triton":  # "ours" reads the neighbouring column as the target
            tgt = (tgt + 1) % n_valid
        return real(h, w, b, tgt, wts, n_valid=n_valid, backend=backend, **kw)

    monkeypatch.setattr(bench, "linear_cross_entropy", off_by_one)
    failed = set(run_checks(bench, torch.float32).failed)
    loss = "loss fp32 N=37 V=4133 n_valid=4100 E=16"
    assert {f"{loss} vs torch reference", f"{loss} vs F.cross_entropy",
            f"{loss} half the logits kept vs F.cross_entropy"} <= failed
    assert not any(name.startswith("softmax") for name in failed)


def test_relative_error_sees_nan() -> None:
    ref = torch.ones(3)
    assert common.relative_error(torch.tensor([1.0, float("nan"), 1.0]), ref) == float("inf")
    assert common.relative_error(torch.tensor([1.0, 1.5, 1.0]), ref) == 0.5


def test_help_and_no_gpu_message(bench: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--help"])
    assert exit_.value.code == 0 and "--dtype" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--dtype", "bf16,fp32"])
    assert str(exit_.value.code).startswith("error: bench.kernels_gpu needs a CUDA GPU")


def test_loss_chunks_argument(bench: ModuleType) -> None:
    assert bench.parse_chunks("0,512, 2048") == [0, 512, 2048]
    for bad in ("", "a,1", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_chunks(bad)


def test_time_loss_runs_each_chunk_size(bench: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture) -> None:
    """The timing code runs on CPU with the CUDA-only calls stubbed: every --loss-chunks value
    reaches linear_cross_entropy (0 as the default tiling), and each run is a real forward +
    backward."""
    seen, real = [], bench.linear_cross_entropy

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(kwargs.get("chunk_size"))
        return real(*args, **kwargs)

    def one_step(fn, inputs):  # noqa: ANN001, ANN202
        fn(*inputs).float().sum().backward()
        assert all(t.grad is not None for t in inputs)
        return 1.0

    monkeypatch.setattr(bench, "linear_cross_entropy", spy)
    monkeypatch.setattr(bench, "fwd_bwd_ms", one_step)
    _without_cuda_calls(monkeypatch)
    bench.time_loss(torch.float32, 40, 300, 16, [0, 8, 32], device="cpu")
    assert seen == [None, 8, 32]
    out = capsys.readouterr().out
    assert "ours, 8 rows a chunk" in out and "compile" in out


def _without_cuda_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's CUDA-only calls (compile for the baseline, memory counters) made no-ops."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    for name in ("reset_peak_memory_stats", "memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda: 0)


def test_head_arguments(bench: ModuleType) -> None:
    assert bench.parse_gib("0, 1,2.5") == [0.0, 1.0, 2.5]
    for bad in ("", "a", "-1", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_gib(bad)


def test_head_flops_count_the_recomputed_rows(bench: ModuleType) -> None:
    """rembert at 16 x 77 rows on CUDA: one forward chunk; kept: 3 vocabulary GEMMs of ~1.03
    TFLOP (the figure docs/kernels.md plans with), recomputed: 4; at 128 rows a chunk with
    room for 500 rows, the first 4 chunks (494 rows) are kept."""
    n, h, e, v = 1232, 1152, 1664, 250_368
    gemm, dense = 2 * n * e * v, 3 * 2 * n * h * e
    assert 1.02e12 < gemm < 1.03e12
    assert bench.head_flops(n, h, e, v, 0, 1.0, 2, True) == dense + 3 * gemm
    assert bench.head_flops(n, h, e, v, 0, 0.0, 2, True) == dense + 4 * gemm
    keep = 500 * v * 2 / 2**30
    assert bench.head_flops(n, h, e, v, 128, keep, 2, True) == dense + 2 * e * v * (
        3 * n + n - 494)


def test_time_head_runs_each_chunk_and_keep(bench: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture) -> None:
    """The head timing on CPU with the CUDA-only calls stubbed, at the tiny preset: every
    (--head-chunks, --head-keep) pair reaches the fused loss through the MLM head, each run
    is a real forward + backward of the head, and every line says how many layers it is."""
    from megatron_rembert.parallel import cross_entropy as parallel_ce

    seen, real = [], parallel_ce.linear_cross_entropy

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append((kwargs["chunk_size"], kwargs["keep_logits_gib"]))
        return real(*args, **kwargs)

    def one_step(fn, inputs):  # noqa: ANN001, ANN202
        fn(*inputs).float().sum().backward()
        # the decoder's gradients go into fp32 main gradients, as in the trainer
        assert all(t.grad is not None or hasattr(t, "main_grad") for t in inputs)
        assert all(t.main_grad.abs().sum() > 0 for t in inputs if hasattr(t, "main_grad"))
        return 2.0

    monkeypatch.setattr(parallel_ce, "linear_cross_entropy", spy)
    monkeypatch.setattr(bench, "fwd_bwd_ms", one_step)
    _without_cuda_calls(monkeypatch)
    figures = bench.time_head(torch.float32, 2, 5, [0, 8], [0.0, 1.0], preset="tiny", seq=16,
                              device="cpu")
    assert seen == [(None, 0.0), (None, 1.0), (8, 0.0), (8, 1.0)]
    assert figures.keys() == gpu_table.SCHEMA["head"]  # what bench.gpu_table reads
    assert figures["best"]["ms"] == 2.0 and figures["layer_ms"] == 2.0
    out = capsys.readouterr().out
    assert "one Transformer layer" in out and "rows 8, keep 1 GiB" in out
    assert out.count("head = 1.00 layers") == 6  # 4 of ours, eager and compiled full logits
