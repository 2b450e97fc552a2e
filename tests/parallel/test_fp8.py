"""train.fp8: the column- and row-parallel linears' GEMMs through torch._scaled_mm (the real
fp8 kernel: it runs on CPU), against a plain-torch reference that quantises the same way,
against bf16/fp32 within fp8's error, at tp = 2 against tp = 1, and under model.compile."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron_rembert.config import ModelConfig
from megatron_rembert.kernels import fp8 as fp8_kernels
from megatron_rembert.model.rembert import RemBertForPreTraining
from megatron_rembert.model.transformer import TransformerLayer
from megatron_rembert.parallel import fp8, state
from megatron_rembert.parallel.layers import ColumnParallelLinear, RowParallelLinear, shard_of
from megatron_rembert.parallel.layout import Layout
from megatron_rembert.parallel.mappings import ALL_REDUCE_COUNTS
from tests.distributed import run_distributed
from tests.model.helpers import random_batch
from tests.parallel.test_tensor_parallel import gather_full

SEED = 1234


def fp8_config(**changes) -> ModelConfig:
    """A small model whose GEMM dimensions are multiples of 16 at tp = 1 and 2."""
    base = ModelConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=256, input_embedding_size=16, output_embedding_size=32,
                       max_position_embeddings=64)
    return base.replace(**changes)


def transformer_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, TransformerLayer)]


# -- the reference: quantise with plain torch, dequantise, multiply in fp32 -------------------
def dequantized(t: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """t through fp8 and back (fp32): scale = the largest power of two with amax * scale <=
    the format's max."""
    fp8_max = torch.finfo(fp8_dtype).max
    scale = 2.0 ** math.floor(math.log2(fp8_max / t.detach().abs().max().item()))
    return (t.detach().float() * scale).to(fp8_dtype).float() / scale


def reference(x, weight, bias, grad):
    """y, dx, dW, db of y = x W^T + b: x and W in e4m3, the output gradient in e5m2."""
    xq = dequantized(x.reshape(-1, x.shape[-1]), torch.float8_e4m3fn)
    wq = dequantized(weight, torch.float8_e4m3fn)
    gq = dequantized(grad.reshape(-1, grad.shape[-1]), torch.float8_e5m2)
    y = xq @ wq.t() + bias.detach().float()
    return (y.view(grad.shape), (gq @ wq).view(x.shape), gq.t() @ xq,
            grad.float().reshape(-1, grad.shape[-1]).sum(0))


def make_layer(kind, in_features, out_features, dtype, seed=0):
    torch.manual_seed(seed)
    layer = kind(in_features, out_features)
    torch.nn.init.normal_(layer.weight, std=0.05)
    torch.nn.init.normal_(layer.bias, std=0.05)
    return layer.to(dtype)


def run_layer(layer, x, grad):
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    y.backward(grad)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def inputs(in_features, out_features, dtype, rows=(3, 7)):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*rows, in_features, generator=g).to(dtype)
    grad = (1e-3 * torch.randn(*rows, out_features, generator=g)).to(dtype)  # small, as grads
    return x, grad


# -- one layer ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float32, 1e-5, 1e-6),
                                               (torch.bfloat16, 2e-2, 5e-3)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [(3, 7), (4, 8)], ids=["21-tokens", "32-tokens"])
def test_linear_matches_the_reference(kind, dtype, rtol, atol, rows):
    """Forward and the gradients of x, W and b against plain-torch quantisation; 21 tokens
    are padded to 32 for the weight gradient, 32 are not."""
    layer = make_layer(kind, 64, 48, dtype)
    fp8.enable_fp8([layer])
    x, grad = inputs(64, 48, dtype, rows)
    ours = run_layer(layer, x, grad)
    for name, got, want in zip(("y", "dx", "dW", "db"), ours,
                               reference(x, layer.weight, layer.bias, grad), strict=True):
        assert got.dtype == dtype, name
        torch.testing.assert_close(got.float(), want, rtol=rtol,
                                   atol=atol * want.abs().max().item(), msg=name)


@pytest.mark.parametrize("kind", [ColumnParallelLinear, RowParallelLinear])
def test_linear_is_within_fp8_error_of_the_plain_linear(kind):
    """Against F.linear in fp32: relative errors of fp8's size (e4m3: 3 mantissa bits,
    e5m2: 2), and not 0 (the GEMMs really ran in fp8)."""
    layer = make_layer(kind, 64, 48, torch.float32)
    x, grad = inputs(64, 48, torch.float32)
    plain = run_layer(layer, x, grad)
    fp8.enable_fp8([layer])
    ours = run_layer(layer, x, grad)
    # Measured: y 0.038, dx 0.060, dW 0.060, db exact (the bias is added in fp32).
    for name, got, want, limit in zip(("y", "dx", "dW", "db"), ours, plain,
                                      (0.06, 0.1, 0.1, 1e-6), strict=True):
        error = ((got - want).norm() / want.norm()).item()
        assert error < limit, (name, error)
        if name != "db":
            assert error > 0.005, (name, error)


def test_gemm_operands_have_the_layouts_cuda_requires(monkeypatch):
    """The CPU kernel takes any strides; CUDA's needs mat1 row-major, mat2 column-major, the
    reduction dimension and mat2's columns multiples of 16, fp32 scalar scales and at most one
    e5m2 operand. Checked on every call of a forward and backward (21 tokens: padded), each
    passed on to torch's `_scaled_mm` (off CUDA the layers use an fp32 GEMM of the same
    operands)."""
    calls = []
    real = torch._scaled_mm

    def spy(a, b, scale_a, scale_b, **kwargs):
        calls.append((a.shape, a.stride(), a.dtype, b.shape, b.stride(), b.dtype,
                      scale_a.dtype, scale_a.numel(), scale_b.dtype, scale_b.numel()))
        return real(a, b, scale_a, scale_b, **kwargs)

    monkeypatch.setattr(fp8_kernels, "_gemm", lambda device: spy)
    layer = make_layer(RowParallelLinear, 64, 48, torch.bfloat16)
    fp8.enable_fp8([layer])
    run_layer(layer, *inputs(64, 48, torch.bfloat16))
    assert len(calls) == 3  # forward, grad-input, grad-weight
    fp8_types = (torch.float8_e4m3fn, torch.float8_e5m2)
    for a_shape, a_stride, a_dtype, b_shape, b_stride, b_dtype, *scales in calls:
        (_, k), (k2, n) = a_shape, b_shape
        assert k == k2
        assert a_stride == (k, 1), "mat1 must be row-major"
        assert b_stride == (1, k), "mat2 must be column-major"
        assert k % 16 == 0 and n % 16 == 0
        assert a_dtype in fp8_types and b_dtype in fp8_types
        assert (a_dtype, b_dtype) != (torch.float8_e5m2, torch.float8_e5m2)
        assert scales == [torch.float32, 1, torch.float32, 1]
    assert [c[2] for c in calls] == [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e5m2]


def test_dimensions_not_multiples_of_16_are_refused():
    layer = ColumnParallelLinear(48, 40)
    with pytest.raises(ValueError, match="40 x 48 weight: fp8 GEMMs need both dimensions "
                                         "multiples of 16"):
        fp8.enable_fp8([layer])


# -- the weight cache ------------------------------------------------------------------------
def test_cached_weights_follow_their_optimizer():
    """Re-quantised once per weight change, not per GEMM: two forwards share one copy; after
    an in-place update (which moves `_version`), or a write that does not move it (DeepSpeed's
    through `.data`, torch's fused AdamW) followed by a step of the optimizer the GEMMs follow,
    the GEMM uses the new weight."""
    layer = make_layer(ColumnParallelLinear, 64, 48, torch.float32)
    gemms = fp8.enable_fp8([layer])
    x, grad = inputs(64, 48, torch.float32)
    run_layer(layer, x, grad)
    run_layer(layer, x, grad)
    assert gemms[0].refreshes == 1

    def forward_matches_reference():
        y = layer(x).detach()
        want = reference(x, layer.weight, layer.bias, grad)[0]
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())

    torch.optim.SGD(layer.parameters(), lr=10.0).step()  # a large step: scales change too
    forward_matches_reference()
    assert gemms[0].refreshes == 2

    optimizer = torch.optim.AdamW(layer.parameters(), lr=1.0, fused=True)
    fp8.follow_optimizer(gemms, optimizer)
    version = layer.weight._version
    run_layer(layer, x, grad)
    optimizer.step()
    assert layer.weight._version == version  # why the cache also follows the optimizer
    forward_matches_reference()
    assert gemms[0].refreshes == 3
    layer.weight.data.copy_(torch.randn_like(layer.weight))  # as DeepSpeed's ZeRO step
    assert layer.weight._version == version
    optimizer.step()  # DeepSpeed steps its wrapped optimizer, then writes the weights
    forward_matches_reference()
    assert gemms[0].refreshes == 4


def test_two_models_keep_their_own_caches():
    """Two fp8 models in one process, each following its own optimizer, and a plain model
    with another: a step of one optimizer renews its own model's fp8 weights only (a
    process-wide hook once renewed every model's at every optimizer step in the process)."""
    layers = [make_layer(ColumnParallelLinear, 64, 48, torch.float32, seed=s) for s in (0, 1)]
    gemms = [fp8.enable_fp8([layer]) for layer in layers]
    optimizers = [torch.optim.AdamW(layer.parameters(), lr=1.0, fused=True)
                  for layer in layers]
    for g, opt in zip(gemms, optimizers, strict=True):
        fp8.follow_optimizer(g, opt)
    plain = torch.nn.Linear(4, 4)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=1.0)
    x, grad = inputs(64, 48, torch.float32)
    before = [layer.weight.detach().clone() for layer in layers]
    for layer in layers:
        run_layer(layer, x, grad)
    plain(torch.ones(4)).sum().backward()
    plain_optimizer.step()  # another model's step
    optimizers[1].step()  # the second fp8 model's
    run_layer(layers[0], x, grad)
    run_layer(layers[1], x, grad)
    assert [g[0].refreshes for g in gemms] == [1, 2]
    assert torch.equal(layers[0].weight, before[0])
    assert not torch.equal(layers[1].weight, before[1])
    for layer in layers:  # each GEMM on its own model's current weight
        want = reference(x, layer.weight, layer.bias, grad)[0]
        torch.testing.assert_close(layer(x).detach(), want, rtol=1e-5,
                                   atol=1e-6 * want.abs().max().item())


# -- tensor parallelism ---------------------------------------------------------------------
def fp8_step(config, batch, dtype=torch.float32):
    """One forward/backward with fp8 Transformer linears: loss, full weights and gradients."""
    model = RemBertForPreTraining(config)
    model.init_weights(SEED)
    model = model.to(dtype)
    fp8.enable_fp8(transformer_layers(model))
    out = model(**batch)
    loss = out.loss_sum / out.num_tokens
    loss.backward()
    grads = {n: gather_full(p, p.grad).float() for n, p in model.named_parameters()}
    return loss.item(), grads


def _tp_worker(rank, world_size, config, batch):
    state.initialize_model_parallel(Layout.build(world_size, rank, tp=world_size))
    try:
        result = fp8_step(config, batch)
    finally:
        state.destroy_model_parallel()
    return result if rank == 0 else None


# Softmax ignores a constant added to a row of scores: the key bias's true gradient is 0 and
# what is computed is rounding noise.
ZERO_GRADIENT = ".attention.key.bias"


@pytest.mark.multiprocess
def test_tp2_model_quantises_as_one_process():
    """Each shard scaled on its own (power-of-two scales): tp = 2 rounds every GEMM operand
    as tp = 1 does, so loss and gradients agree to fp32's rounding of the split sums, far
    inside fp8's error (~4-6% per GEMM)."""
    config = fp8_config()
    batch = random_batch(config, seq=16)
    loss, grads = fp8_step(config, batch)
    tp_loss, tp_grads = run_distributed(_tp_worker, 2, config, batch)[0]
    assert tp_loss == pytest.approx(loss, rel=1e-5)
    for name, grad in grads.items():
        if not name.endswith(ZERO_GRADIENT):
            torch.testing.assert_close(tp_grads[name], grad, rtol=1e-4,
                                       atol=1e-4 * grad.abs().max().item(), msg=name)


def uneven_operands(kind):
    """Full weight, bias, input and output gradient of a 64 -> 64 layer whose TP shards
    differ in size by 2^3 (the weight) and 2^5 (the split activation or gradient): scaled on
    its own, the small shard gets a scale 8 or 32 times the whole tensor's."""
    layer = make_layer(kind, 64, 64, torch.float32)
    x, grad = inputs(64, 64, torch.float32)
    split = 0 if kind is ColumnParallelLinear else 1
    weight = layer.weight.detach().clone()
    weight.narrow(split, weight.shape[split] // 2, weight.shape[split] // 2).mul_(2.0**-3)
    if kind is ColumnParallelLinear:
        grad[..., 32:] *= 2.0**-5  # the output gradient is split
    else:
        x[..., 32:] *= 2.0**-5  # the input is split
    return weight, layer.bias.detach().clone(), x, grad


def layer_results(kind, weight, bias, x, grad):
    """y, dx, dW of this rank's layer (tp from parallel.state), its shards cut from the full
    tensors; full tensors returned (gathered; dx of a column layer summed)."""
    rank, size = state.tp_rank(), state.tp_size()
    layer = kind(64, 64)
    with torch.no_grad():
        layer.weight.copy_(shard_of(weight, layer.weight.tp_split_dim, rank, size))
        layer.bias.copy_(shard_of(bias, layer.bias.tp_split_dim, rank, size))
    fp8.enable_fp8([layer])
    column = kind is ColumnParallelLinear
    x_local = (x if column else x.chunk(size, -1)[rank]).clone().requires_grad_()
    y = layer(x_local)
    y.backward(grad.chunk(size, -1)[rank] if column else grad)
    y, dx = y.detach(), x_local.grad
    if size > 1:
        if column:
            y = gather_last_dim(y)
            dist.all_reduce(dx, group=state.tp_group())
        else:
            dx = gather_last_dim(dx)
    return y, dx, gather_full(layer.weight, layer.weight.grad)


def gather_last_dim(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(state.tp_size())]
    dist.all_gather(parts, t.contiguous(), group=state.tp_group())
    return torch.cat(parts, dim=-1)


def _layer_worker(rank, world_size, kind, operands):
    state.initialize_model_parallel(Layout.build(world_size, rank, tp=world_size))
    try:
        return layer_results(kind, *operands)
    finally:
        state.destroy_model_parallel()


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", [ColumnParallelLinear, RowParallelLinear])
def test_tp2_layer_with_uneven_shards_quantises_as_one_process(kind):
    """The case where per-shard scales differ most from the whole tensor's (8x and 32x):
    still the single-process fp8 result, to fp32 rounding (the small shard's elements are
    normal fp8 numbers under either scale). A scale that is not a power of two fails this."""
    operands = uneven_operands(kind)
    one = layer_results(kind, *operands)
    two = run_distributed(_layer_worker, 2, kind, operands)[0]
    for name, got, want in zip(("y", "dx", "dW"), two, one, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                                   msg=name)


def _count_worker(rank, world_size, config):
    state.initialize_model_parallel(Layout.build(world_size, rank, tp=world_size))
    layer = TransformerLayer(config)
    fp8.enable_fp8([layer])
    x = torch.randn(2, 8, config.hidden_size, requires_grad=True)
    ALL_REDUCE_COUNTS.clear()
    y = layer(x, None)
    forward = dict(ALL_REDUCE_COUNTS)
    ALL_REDUCE_COUNTS.clear()
    y.sum().backward()
    backward = dict(ALL_REDUCE_COUNTS)
    state.destroy_model_parallel()
    return forward, backward


@pytest.mark.multiprocess
def test_fp8_adds_no_collective():
    """The communication plan under fp8 is bf16's: one all-reduce per block each way."""
    forward, backward = run_distributed(_count_worker, 2, fp8_config())[0]
    assert forward == {"forward": 2}
    assert backward == {"backward": 2}


# -- model.compile ---------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_compiled_layers_equal_eager_layers():
    """model.compile with fp8: the fp8 GEMMs run outside the compiled graphs, the rest of each
    layer inside; in fp32 both agree to rounding (fp8 quantisation snaps the tiny differences
    of the compiled LayerNorm and GELU away, or moves a value one fp8 step: hence 1e-4)."""
    batch = random_batch(fp8_config(), seq=16)
    loss, grads = fp8_step(fp8_config(), batch)
    loss_c, grads_c = fp8_step(fp8_config(compile=True), batch)
    assert loss_c == pytest.approx(loss, rel=1e-5)
    for name, grad in grads.items():
        if not name.endswith(ZERO_GRADIENT):
            torch.testing.assert_close(grads_c[name], grad, rtol=1e-4,
                                       atol=1e-4 * grad.abs().max().item(), msg=name)
    assert all(grads_c[n].abs().max() > 0 for n in grads if n.endswith("query.weight"))

