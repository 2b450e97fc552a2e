"""The input embedding's backward into the trainer's fp32 main gradient (kernels/embedding.py):
the same gradient as F.embedding's dense one, at TP = 1 and sharded over TP = 2, with the
padding row left out, accumulated over micro-batches, and no dense gradient for the table."""

import pytest
import torch
import torch.nn.functional as F

from megatron_rembert.parallel import state
from megatron_rembert.parallel.layers import VocabParallelEmbedding, init_weights
from megatron_rembert.parallel.layout import Layout
from tests.distributed import run_distributed

VOCAB, PADDED, DIM, PAD = 200, 256, 16, 0


def _ids(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 40), generator=g)  # B x S, repeated ids
    ids[:, -5:] = PAD  # padding positions
    ids[0, :10] = 7  # one id many times: its rows add up
    return ids


def _embedding(dtype) -> VocabParallelEmbedding:
    emb = VocabParallelEmbedding(PADDED, DIM, VOCAB, padding_idx=PAD)
    init_weights(emb, 3, 0.02)
    return emb.to(dtype)


def _reference(dtype, micro_batches: int) -> torch.Tensor:
    """Dense gradients of F.embedding (fp32 arithmetic on the same values), summed."""
    weight = _embedding(dtype).weight.detach().float().requires_grad_()
    for mb in range(micro_batches):
        out = F.embedding(_ids(mb), weight, padding_idx=PAD)
        out.backward(_grad_out(mb, dtype).float())
    return weight.grad


def _grad_out(seed: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(3, 40, DIM, generator=g).to(dtype)


def _main_grad_run(dtype, micro_batches: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As the trainer's gradient buffer sets the table up: its main gradient and the report
    of each backward's addition (counted here: one per backward)."""
    emb = _embedding(dtype)
    emb.weight.main_grad = torch.zeros(emb.weight.shape, dtype=torch.float32)
    reports = []
    emb.weight.main_grad_added = lambda: reports.append(emb.weight.main_grad.sum().item())
    for mb in range(micro_batches):
        emb(_ids(mb)).backward(_grad_out(mb, dtype))
    # reported once per backward, after its rows were added (the sum had changed each time)
    assert len(reports) == micro_batches and len(set(reports)) == micro_batches
    return emb.weight.main_grad, emb.weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_main_grad_equals_dense_gradient(dtype):
    main_grad, dense = _main_grad_run(dtype, micro_batches=2)
    reference = _reference(dtype, micro_batches=2)
    assert dense is None  # autograd got no gradient for the table
    assert torch.allclose(main_grad, reference, atol=1e-6, rtol=1e-6)
    assert main_grad[PAD].abs().max() == 0  # the padding row takes no gradient
    assert main_grad[VOCAB:].abs().max() == 0  # nor the vocabulary padding rows
    assert main_grad[7].abs().max() > 0


def test_without_main_grad_the_gradient_is_dense():
    emb = _embedding(torch.float32)
    emb(_ids(0)).backward(_grad_out(0, torch.float32))
    assert torch.equal(emb.weight.grad, _reference(torch.float32, micro_batches=1))


def _tp_worker(rank, world_size):
    layout = Layout.build(world_size, rank, tp=world_size, pp=1, micro_batch_size=1,
                          global_batch_size=1)
    state.initialize_model_parallel(layout)
    main_grad, dense = _main_grad_run(torch.float32, micro_batches=2)
    return main_grad, dense is None


@pytest.mark.multiprocess
def test_tensor_parallel_shards_equal_the_single_process_gradient():
    (shard0, none0), (shard1, none1) = run_distributed(_tp_worker, 2)
    assert none0 and none1
    full = torch.cat([shard0, shard1])
    assert torch.allclose(full, _reference(torch.float32, micro_batches=2), atol=1e-6,
                          rtol=1e-6)
