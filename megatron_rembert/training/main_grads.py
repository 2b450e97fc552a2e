"""fp32 main gradients for DeepSpeed's BF16_Optimizer, without its copies.

bf16 with ZeRO-1 and fp32 gradient accumulation (what configs/rembert.yaml trains with) runs
under DeepSpeed's BF16_Optimizer: bf16 weights, fp32 master weights, and fp32 gradients in one
flat buffer per parameter group. DeepSpeed's own path moves every gradient several times (per
parameter, bytes read + written):
- per micro-batch, autograd writes a bf16 gradient, which `update_hp_grads` converts into an
  fp32 temporary and adds into the buffer (2 + 2 + 4 + 4 + 8 = 20 bytes);
- per step, the flat buffers are concatenated into a new tensor, all-reduced (at dp = 1 too) and
  copied back (24 bytes); the norm is taken tensor by tensor; clipping multiplies every
  gradient (8); the buffer is zeroed twice (8).

This module keeps DeepSpeed's buffers, optimizer states, checkpoints and step bookkeeping
(global steps, LR scheduler, skipped steps) and replaces the movement:
- every parameter gets `main_grad`, its fp32 view in the flat buffer. A post-accumulate-grad
  hook adds the bf16 gradient into it and frees it (10 bytes, and no bf16 gradient of the
  whole model stays alive until the end of backward). Kernels that can accumulate in fp32
  themselves (the MLM loss's output embedding, the input embedding) add straight into
  `main_grad` and give autograd no gradient for that parameter;
- the optimizer step: each flat buffer SUM-all-reduced in place over DP (not at all for dp = 1;
  the trainer's loss factor then leaves the DP average out), the norm by `torch._foreach_norm`
  over the views (TP shards and pipeline stages summed over the model-parallel group,
  replicated parameters counted on TP rank 0 only, as DeepSpeed counts them), read once on the
  host (DeepSpeed skips a step whose norm is not finite and reports the norm), clipping folded
  into the fused AdamW (`grad_scale`, no pass of its own) and applied to this rank's partition
  only, DeepSpeed's `update_lp_params` (fp32 -> bf16, all-gather over DP), one zero of the
  buffers.
"""

from __future__ import annotations

import math

import torch

from megatron_rembert.parallel import comm, state
from megatron_rembert.parallel.layers import is_tp_sharded
from megatron_rembert.training import deepspeed_private

CLIP_EPS = 1e-6  # as DeepSpeed's clip_tensors_by_global_norm


def uses_bf16_optimizer(optimizer) -> bool:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return isinstance(optimizer, BF16_Optimizer)


def _accumulate(param: torch.Tensor) -> None:
    # None: a kernel added this micro-batch's gradient into main_grad itself (autograd still
    # runs the parameter's hooks for the undefined gradient it was given).
    if param.grad is not None:
        param.main_grad.add_(param.grad)  # bf16 into fp32, no temporary
        param.grad = None


def attach_main_grad(param: torch.nn.Parameter, buffer: torch.Tensor) -> None:
    """From now on `param`'s gradients are summed into `buffer` (fp32, param's shape): kernels
    that can add in fp32 add there themselves, autograd's gradient is added by a hook and
    freed."""
    param.main_grad = buffer
    param.register_post_accumulate_grad_hook(_accumulate)


class MainGradients:
    """Installs the path above on a built engine whose optimizer is DeepSpeed's BF16_Optimizer;
    the engine's own gradient reduction is switched off."""

    def __init__(self, engine, pipeline: bool):
        opt = engine.optimizer
        deepspeed_private.check_bf16_optimizer(opt)
        self.optimizer = opt
        self.sharded, self.replicated = [], []
        for group, views in zip(opt.bf16_groups, opt.fp32_groups_gradients, strict=True):
            for param, view in zip(group, views, strict=True):
                attach_main_grad(param, view.view(param.shape))
                (self.sharded if is_tp_sharded(param) else self.replicated).append(param.main_grad)
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
            for flat in opt.fp32_groups_gradients_flat:
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
        for param, grad in zip(opt.fp32_groups_flat_partition,
                               opt.fp32_groups_gradient_flat_partition, strict=True):
            param.grad = grad
            if coef < 1 and not fold:
                grad.mul_(coef)
        if fold:  # fused AdamW divides each gradient by grad_scale inside its one kernel
            base.grad_scale = torch.tensor(1.0 / coef, dtype=torch.float32,
                                           device=opt.fp32_groups_flat_partition[0].device)
        try:
            base.step()
        finally:
            if fold:
                del base.grad_scale
        deepspeed_private.link_optimizer_state_once(opt)
        opt.update_lp_params()
        self._zero()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """What the engine calls after each step: the buffers are zeroed by `step` already,
        and the bf16 gradients were freed by the hooks."""
        for group in self.optimizer.bf16_groups:
            for param in group:
                param.grad = None

    def _zero(self) -> None:
        for flat in self.optimizer.fp32_groups_gradients_flat:
            flat.zero_()


def _has_grad_scale(optimizer) -> bool:
    """torch's fused Adam/AdamW read `optimizer.grad_scale` (set by torch.amp's GradScaler) and
    divide every gradient by it in the update kernel."""
    return (isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
            and all(g.get("fused") for g in optimizer.param_groups))
