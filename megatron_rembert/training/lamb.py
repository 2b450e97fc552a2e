"""LAMB (You et al., 2020, "Large batch optimization for deep learning: training BERT in 76
minutes") whose trust ratios are those of whole parameters, in every parallel layout.

LAMB scales the Adam update u of each parameter w by ||w|| / ||u||. A rank rarely holds a whole
parameter: tensor parallelism gives it a shard, and the distributed optimizer
(training/distributed_optimizer.py) hands it fragments of parameters cut at bucket-shard
boundaries. Norms over what one rank holds would make training depend on the layout. Here the
squared norms are summed over every fragment of a parameter on the data-parallel ranks
(`use_fragments`) and over its tensor-parallel shards, so tp x pp x dp takes the steps of one
process (tests/training/test_lamb.py).

Conventions of NVIDIA's BERT LAMB and the reference TensorFlow implementation: Adam moments with
bias correction; decoupled weight decay added to the update; the trust ratio only for the
parameters that get weight decay (biases and LayerNorm take the plain update); ratio 1 where a
norm is zero. Gradient clipping (global norm) is the distributed optimizer's, before the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_rembert.parallel import comm
from megatron_rembert.parallel.layers import is_tp_sharded


@dataclass
class _Fragments:
    """Where a group's logical parameters lie in the tensors the optimizer updates."""
    tensors: list[int]  # per fragment: index of the tensor in group["params"]
    starts: list[int]  # per fragment: first element in that (flattened) tensor
    sizes: list[int]
    ids: torch.Tensor  # per fragment: logical parameter index
    sharded: torch.Tensor  # per logical parameter: split across the tensor-parallel group
    dp_group: object = None  # set when fragments of one parameter are spread over DP ranks
    key: tuple = ()


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, tp_group=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.tp_group = tp_group
        self._fragments: dict[int, _Fragments] = {}
        self._given: dict[int, _Fragments] = {}

    def use_fragments(self, groups: list[tuple[list[int], list[bool]]], dp_group) -> None:
        """group["params"] are fragments of whole parameters spread over the ranks of
        `dp_group` (training/distributed_optimizer.py): per parameter group, the index of the
        whole parameter each tensor is part of, and per whole parameter of the group (on every
        rank the same list, a rank holding no fragment of it included) whether it is split
        across the TP group. Every rank then steps every group, even one it holds nothing of:
        the trust ratios' sums are collectives."""
        if len(groups) != len(self.param_groups):
            raise ValueError(f"Lamb.use_fragments: {len(groups)} groups for "
                             f"{len(self.param_groups)} parameter groups")
        self._given = {}
        for index, ((ids, sharded), group) in enumerate(zip(groups, self.param_groups,
                                                             strict=True)):
            params = group["params"]
            if len(ids) != len(params):
                raise ValueError(f"Lamb.use_fragments: group {index} has {len(params)} "
                                 f"tensors, {len(ids)} parameter indices")
            self._given[index] = _Fragments(
                tensors=list(range(len(params))), starts=[0] * len(params),
                sizes=[p.numel() for p in params], ids=torch.tensor(ids, dtype=torch.long),
                sharded=torch.tensor(sharded, dtype=torch.bool), dp_group=dp_group)

    # -- where the parameters are ------------------------------------------------------------
    def _plain_fragments(self, params: list[torch.Tensor]) -> _Fragments:
        n = len(params)
        return _Fragments(tensors=list(range(n)), starts=[0] * n,
                          sizes=[p.numel() for p in params], ids=torch.arange(n),
                          sharded=torch.tensor([is_tp_sharded(p) for p in params]))

    def _group_fragments(self, index: int, group: dict) -> _Fragments:
        if index in self._given:
            return self._given[index]
        params = group["params"]
        key = tuple((p.data_ptr(), p.numel()) for p in params)
        cached = self._fragments.get(index)
        if cached is None or cached.key != key:
            cached = self._plain_fragments(params)
            cached.key = key
            self._fragments[index] = cached
        return cached

    # -- the step ------------------------------------------------------------------------------
    def _trust_ratios(self, fragments: _Fragments, weights: list[torch.Tensor],
                      updates: list[torch.Tensor]) -> list[float]:
        """||w|| / ||u|| of each fragment's whole parameter."""
        count = len(fragments.sharded)
        device = weights[0].device if weights else torch.device("cpu")
        sums = torch.zeros(2, count, dtype=torch.float32, device=device)
        if weights:
            norms = torch.stack([torch.stack(torch._foreach_norm(weights)),
                                 torch.stack(torch._foreach_norm(updates))]).float()
            sums.index_add_(1, fragments.ids.to(device), norms.square())
        if fragments.dp_group is not None:
            comm.all_reduce(sums, group=fragments.dp_group)
        if self.tp_group is not None and bool(fragments.sharded.any()):
            mask = fragments.sharded.to(device)
            shards = sums[:, mask].contiguous()
            comm.all_reduce(shards, group=self.tp_group)
            sums[:, mask] = shards
        w_norm, u_norm = sums.sqrt()
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm,
                            torch.ones_like(w_norm))
        return ratio[fragments.ids.to(device)].tolist()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            params = group["params"]
            if not params:
                if index in self._given and group["weight_decay"]:
                    # no fragment here, but the other ranks sum their norms with ours
                    self._trust_ratios(self._given[index], [], [])
                continue
            fragments = self._group_fragments(index, group)
            beta1, beta2 = group["betas"]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), device=p.device)  # on the device, as torch
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p,
                                                           memory_format=torch.preserve_format)
                state["step"] += 1
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            exp_avg = [self.state[p]["exp_avg"] for p in params]
            exp_avg_sq = [self.state[p]["exp_avg_sq"] for p in params]
            step = self.state[params[0]]["step"].item()
            torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sq, beta2)
            torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
            # u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w, in one temporary per tensor
            updates = torch._foreach_sqrt(exp_avg_sq)
            torch._foreach_div_(updates, math.sqrt(1 - beta2 ** step))
            torch._foreach_add_(updates, group["eps"])
            torch._foreach_reciprocal_(updates)
            torch._foreach_mul_(updates, exp_avg)
            torch._foreach_div_(updates, 1 - beta1 ** step)
            if group["weight_decay"]:
                torch._foreach_add_(updates, params, alpha=group["weight_decay"])
                flat_w = [params[t].view(-1).narrow(0, s, n) for t, s, n in
                          zip(fragments.tensors, fragments.starts, fragments.sizes, strict=True)]
                flat_u = [updates[t].view(-1).narrow(0, s, n) for t, s, n in
                          zip(fragments.tensors, fragments.starts, fragments.sizes, strict=True)]
                ratios = self._trust_ratios(fragments, flat_w, flat_u)
                if flat_u:
                    torch._foreach_mul_(flat_u, ratios)
            torch._foreach_add_(params, updates, alpha=-group["lr"])
        return loss
