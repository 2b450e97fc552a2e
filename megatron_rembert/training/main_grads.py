"""fp32 main gradients for DeepSpeed's ZeRO-1 optimizers, without their copies.

Two DeepSpeed wrappers train with ZeRO-1 here, and both move every gradient several times:
- bf16 with fp32 gradient accumulation (configs/rembert.yaml) runs under DeepSpeed's
  BF16_Optimizer: bf16 weights, fp32 master weights, and fp32 gradients in one flat buffer per
  parameter group. Per parameter, bytes read + written: per micro-batch autograd writes a bf16
  gradient, which `update_hp_grads` converts into an fp32 temporary and adds into the buffer
  (2 + 2 + 4 + 4 + 8 = 20); per step the flat buffers are concatenated into a new tensor,
  all-reduced (at dp = 1 too) and copied back (24); the norm is taken tensor by tensor; clipping
  multiplies every gradient (8); the buffer is zeroed twice (8).
- fp32 (configs/demo.yaml, tiny.yaml: ds_configs/cpu_fp32.json) runs under
  DeepSpeedZeroOptimizer, which keeps an fp32 master copy of the fp32 weights: gradient hooks
  copy every gradient into reduction buckets, the buckets into a flat partition, the master
  copy is stepped and copied back into the weights. On CPU those copies were 4 s of a 7.5 s
  step of the 488M-parameter bench model, whose forward and backward take 2.1 s
  (bench/train_throughput.py --engine --precision fp32).

This module keeps DeepSpeed's optimizer states, checkpoints and step bookkeeping (global
steps, LR scheduler, skipped steps) and replaces the movement:
- every parameter gets `main_grad`, its fp32 view in one flat buffer per group (BF16_Optimizer's
  own; for DeepSpeedZeroOptimizer one laid out as its flat weights). A post-accumulate-grad
  hook adds autograd's gradient into it and frees it (no gradient of the whole model stays
  alive until the end of backward). Kernels that can accumulate in fp32 themselves (the MLM
  loss's output embedding, the input embedding) add straight into `main_grad` and give
  autograd no gradient for that parameter;
- the optimizer step: each flat buffer SUM-all-reduced in place over DP (not at all for dp = 1;
  the trainer's loss factor then leaves the DP average out), the norm by `torch._foreach_norm`
  over the views (TP shards and pipeline stages summed over the model-parallel group,
  replicated parameters counted on TP rank 0 only, as DeepSpeed counts them), read once on the
  host (DeepSpeed skips a step whose norm is not finite and reports the norm), clipping folded
  into the fused AdamW (`grad_scale`, no pass of its own) and applied to this rank's partition
  only, the weights refreshed from the masters (bf16: DeepSpeed's `update_lp_params`, fp32 ->
  bf16 and an all-gather over DP; fp32: the master partition *is* this rank's slice of the flat
  weights, so only the all-gather over DP remains), one zero of the buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_rembert.parallel import comm, state
from megatron_rembert.parallel.layers import is_tp_sharded
from megatron_rembert.training import deepspeed_private

CLIP_EPS = 1e-6  # as DeepSpeed's clip_tensors_by_global_norm


def applies(config) -> bool:
    """Whether a run trains on this path: ZeRO-1 in bf16 (DeepSpeed's BF16_Optimizer) or in fp32
    (its DeepSpeedZeroOptimizer). fp16 keeps DeepSpeed's own path (its loss scale and overflow
    checks), ZeRO-2 too (it partitions the gradients, which one flat buffer would not), and
    fp32 without ZeRO has no wrapper (the engine all-reduces the gradients itself)."""
    return config.parallel.zero_stage == 1 and config.train.precision in ("bf16", "fp32")


def summed_by_kernels(model_config) -> tuple[str, ...]:
    """Names (suffixes) of the parameters whose gradients kernels add into `main_grad`
    themselves: the input embedding (parallel/layers.py) and, with the fused loss, the output
    embedding and its bias (model/mlm_head.py). Autograd hands no gradient for them."""
    head = (("decoder.weight", "decoder.bias") if model_config.loss_backend == "fused" else ())
    return ("word_embeddings.weight", *head)


def _accumulate(param: torch.Tensor) -> None:
    # None: a kernel added this micro-batch's gradient into main_grad itself (autograd still
    # runs the parameter's hooks for the undefined gradient it was given).
    if param.grad is not None:
        param.main_grad.add_(param.grad)  # bf16 into fp32: no temporary
        param.grad = None


def attach_main_grad(param: torch.nn.Parameter, buffer: torch.Tensor) -> None:
    """From now on `param`'s gradients are summed into `buffer` (fp32, param's shape): kernels
    that can add in fp32 add there themselves, autograd's gradient is added by a hook and
    freed."""
    param.main_grad = buffer
    param.register_post_accumulate_grad_hook(_accumulate)


@dataclass
class _Buffers:
    """Where a wrapper keeps what the step works on."""
    params: list[tuple[torch.nn.Parameter, torch.Tensor]]  # (parameter, its fp32 view)
    flats: list[torch.Tensor]  # whole flat fp32 gradient buffers (DP all-reduce, zero)
    partitions: list[tuple[torch.Tensor, torch.Tensor]]  # this rank's (master, its gradient)
    refresh_weights: Callable[[], None]  # masters -> the model's weights on every DP rank


def _bf16_buffers(opt) -> _Buffers:
    deepspeed_private.check_bf16_optimizer(opt)
    params = [(param, view.view(param.shape))
              for group, views in zip(opt.bf16_groups, opt.fp32_groups_gradients, strict=True)
              for param, view in zip(group, views, strict=True)]
    return _Buffers(params, list(opt.fp32_groups_gradients_flat),
                    list(zip(opt.fp32_groups_flat_partition,
                             opt.fp32_groups_gradient_flat_partition, strict=True)),
                    opt.update_lp_params)


def _offset(tensor: torch.Tensor, flat: torch.Tensor) -> int:
    """Where `tensor` starts inside `flat` (a view of the same storage), in elements."""
    if tensor.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
        raise RuntimeError("DeepSpeed's ZeRO-1 weights are not views of its flat buffer")
    return tensor.storage_offset() - flat.storage_offset()


def _fp32_zero1_buffers(opt) -> _Buffers:
    """DeepSpeedZeroOptimizer with fp32 weights: a flat fp32 gradient buffer per group laid out
    as the flat weights, and the master partition replaced by this rank's slice of the flat
    weights (DeepSpeed's master was a copy of it, stepped and copied back every step)."""
    params, flats, partitions = [], [], []
    for i, (group, flat) in enumerate(zip(opt.bit16_groups, opt.bit16_groups_flat,
                                          strict=True)):
        grads = torch.zeros_like(flat)
        flats.append(grads)
        for param in group:
            start = _offset(param.data, flat)
            params.append((param, grads[start:start + param.numel()].view(param.shape)))
        rank = torch.distributed.get_rank(group=opt.real_dp_process_group[i])
        lp = opt.parallel_partitioned_bit16_groups[i][rank]
        start = _offset(lp, flat)
        master = lp.detach().requires_grad_(True)  # as DeepSpeed's, for the inner optimizer
        partitions.append((master, grads[start:start + lp.numel()]))
    deepspeed_private.replace_fp32_partitions(opt, [master for master, _ in partitions])
    deepspeed_private.remove_zero_gradient_hooks(opt)
    return _Buffers(params, flats, partitions, opt.update_lp_params)


class MainGradients:
    """Installs the path above on a built engine of a run this `applies` to; the engine's own
    gradient reduction is switched off."""

    def __init__(self, engine, pipeline: bool):
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

        opt = engine.optimizer
        self.optimizer = opt
        if isinstance(opt, BF16_Optimizer):
            self.buffers = _bf16_buffers(opt)
        elif deepspeed_private.is_fp32_zero1(opt):
            self.buffers = _fp32_zero1_buffers(opt)
        else:
            raise RuntimeError(f"fp32 main gradients: DeepSpeed built {type(opt).__name__}, not "
                               "its BF16_Optimizer or a ZeRO-1 optimizer of fp32 weights")
        self.sharded, self.replicated = [], []
        for param, view in self.buffers.params:
            attach_main_grad(param, view)
            (self.sharded if is_tp_sharded(param) else self.replicated).append(view)
        deepspeed_private.disable_engine_gradient_reduction(engine, pipeline)
        opt.step = self.step
        opt.zero_grad = self.zero_grad

    @torch.no_grad()
    def norm(self) -> torch.Tensor:
        """The whole model's gradient norm (a device scalar, fp32)."""
        parallel = state.get_state()
        lists = [self.sharded] + ([self.replicated] if parallel.tp_rank == 0 else [])
        squares = torch.zeros(1, dtype=torch.float32, device=comm.device())
        for grads in lists:
            if grads:
                squares += torch.stack(torch._foreach_norm(grads)).square().sum()
        if parallel.model_group is not None:
            comm.all_reduce(squares, group=parallel.model_group)
        return squares.sqrt()[0]

    @torch.no_grad()
    def step(self, closure=None) -> None:
        opt, parallel = self.optimizer, state.get_state()
        if parallel.dp > 1:
            for flat in self.buffers.flats:
                comm.all_reduce(flat, group=parallel.dp_group)
        norm = float(self.norm())  # the optimizer step's one host read
        deepspeed_private.set_global_grad_norm(opt, norm)
        opt.overflow = not math.isfinite(norm)
        if opt.overflow:  # DeepSpeed's rule: skip the step, keep the weights
            deepspeed_private.set_global_grad_norm(opt, float("inf"))
            self._zero()
            return
        coef = opt.clip_grad / (norm + CLIP_EPS) if opt.clip_grad > 0 else 1.0
        base = opt.optimizer
        fold = coef < 1 and _has_grad_scale(base)
        for master, grad in self.buffers.partitions:
            master.grad = grad
            if coef < 1 and not fold:
                grad.mul_(coef)
        if fold:  # fused AdamW divides each gradient by grad_scale inside its one kernel
            base.grad_scale = torch.tensor(1.0 / coef, dtype=torch.float32,
                                           device=self.buffers.partitions[0][0].device)
        try:
            base.step()
        finally:
            if fold:
                del base.grad_scale
        deepspeed_private.link_optimizer_state_once(opt)
        self.buffers.refresh_weights()
        self._zero()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """What the engine calls after each step: the buffers are zeroed by `step` already,
        and autograd's gradients were freed by the hooks."""
        for param, _ in self.buffers.params:
            param.grad = None

    def _zero(self) -> None:
        for flat in self.buffers.flats:
            flat.zero_()


def _has_grad_scale(optimizer) -> bool:
    """torch's fused Adam/AdamW read `optimizer.grad_scale` (set by torch.amp's GradScaler) and
    divide every gradient by it in the update kernel."""
    return (isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
            and all(g.get("fused") for g in optimizer.param_groups))
