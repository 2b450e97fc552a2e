"""The correctness checks of bench/gpu_checks.sh as tests (`pytest -m gpu` on a GPU machine;
skipped without CUDA, tests/conftest.py), so that a CUDA-only regression fails a test: the
Triton kernels against their torch references and F.cross_entropy (bench.kernels_gpu's
checks), model.compile's layers against eager ones (bench.layer_fusion), the trainer's
micro-batches under torch.cuda.set_sync_debug_mode("error") (bench.train_throughput), and the
fp8 GEMMs against plain-torch quantisation and fp8 training against bf16 (bench.fp8_gpu).
tests/kernels/test_aot_compile.py compiles every kernel for the GPU's own architecture. No
timing is asserted; the benches time. On CPU the same check functions run at small sizes in
tests/kernels/test_kernels_gpu_bench.py, tests/bench/test_fp8_gpu.py and
tests/bench/test_layer_fusion.py."""

from __future__ import annotations

import os

import pytest
import torch

from bench import fp8_gpu, kernels_gpu, layer_fusion, train_throughput
from bench.common import make_batch
from megatron_rembert.config import get_preset
from tests.distributed import run_distributed

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


# Where CUDA is missing the conftest's skip says so; this one is for GPUs without fp8.
no_fp8 = pytest.mark.skipif(torch.cuda.is_available()
                            and torch.cuda.get_device_capability() < (8, 9),
                            reason="no fp8 tensor cores (compute capability < 8.9)")


def skip_under_the_interpreter() -> None:
    """In a run of the whole suite conftest turns the Triton interpreter on, which would run
    the kernels on the host: these tests are for the compiled ones."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("the Triton interpreter is on: run the GPU tests alone, `pytest -m gpu`")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernels_match_their_references(dtype):
    """The compiled Triton kernels (not the interpreter) against the torch references and
    eager torch: softmax at 4 shapes, the loss with kept logits, padding columns and weight-0
    rows, at a vocabulary of several column tiles."""
    skip_under_the_interpreter()
    checks = kernels_gpu.Checks()
    kernels_gpu.check_softmax(dtype, checks)
    kernels_gpu.check_loss(dtype, 1024, 32768, 32768, 512, 0.0, checks)
    kernels_gpu.check_loss(dtype, 777, 4133, 4100, 256, 0.25, checks)  # padding, weight-0 rows
    assert checks.total == 2 * len(kernels_gpu.SOFTMAX_SHAPES) + 8
    assert checks.failed == []


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_compiled_layers_equal_eager_layers(dropout):
    """model.compile on the GPU: the compiled rembert layers give the eager layers' output
    (bf16; with dropout both draw the same masks) without a graph break."""
    config = get_preset("rembert").replace(hidden_dropout_prob=dropout,
                                           attention_probs_dropout_prob=dropout)
    torch._dynamo.reset()
    shape = dict(batch=2, seq=128, layers=2, iters=1, masked=False)
    _, passed = layer_fusion.measure(config, shape, CUDA, torch.bfloat16,
                                     torch.cuda.synchronize)
    assert passed


def _sync_worker(rank, world_size) -> list[str]:
    """The trainer's micro-batches (bf16 + zero1_bf16.json, gas 2) under sync_debug_mode
    "error", twice: the first step and one after the optimizer has stepped."""
    from megatron_rembert.launch_env import launch_env
    from megatron_rembert.parallel import state
    from megatron_rembert.training.distributed import setup_distributed
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.plan import RunPlan

    _, _, device = setup_distributed(launch_env(), 5.0)
    config = get_preset("tiny").replace(vocab_size=4096)
    run = train_throughput.engine_run_config(config, "bf16", micro=2, gas=2, seq=64)
    plan = RunPlan.build(run, 1)
    state.initialize_model_parallel(plan.layout)
    trainer = Trainer(run, plan, device)
    return [train_throughput.micro_batches_sync_check(
        trainer, [make_batch(config, 2, 64, 2 * step + i, "cpu") for i in range(2)])
        for step in range(2)]


@pytest.mark.multiprocess
def test_trainer_micro_batches_never_wait_for_the_gpu():
    skip_under_the_interpreter()
    verdicts = run_distributed(_sync_worker, 1, timeout=600, init_process_group=False)[0]
    assert verdicts == ["clean", "clean"]


@no_fp8
def test_fp8_gemms_match_plain_torch_quantisation():
    """cuBLASLt's fp8 GEMMs at rembert's shapes: y, dx and dW of the column- and row-parallel
    linears against x, W (e4m3) and dy (e5m2) quantised by plain torch."""
    assert fp8_gpu.check_gemms(CUDA) == []


@no_fp8
def test_fp8_trains_the_demo_model_like_bf16():
    """configs/demo.yaml's model, 300 steps on the synthetic batches: bf16 learns, and fp8's
    final loss is within 5% of bf16's."""
    curves = [fp8_gpu.loss_curve(fp8_gpu.DEMO_MODEL, 300, fp8_gpu.DEMO_BATCH, fp8_gpu.DEMO_SEQ,
                                 CUDA, fp8) for fp8 in (False, True)]
    assert curves[0][-1] < fp8_gpu.LEARNT * curves[0][0]
    assert fp8_gpu.compare_curves(*curves, tolerance=0.05) == []
