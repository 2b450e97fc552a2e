"""A ZeRO-1 optimizer over parallel/grad_buffer.py's buckets: each DP rank steps its own shard.

DP rank r owns shard r of every bucket of the gradient buffer. For each parameter it keeps the
fragment that falls into its shards (a parameter may straddle two ranks' shards, or lie in one
rank's only):
- an fp32 master of that fragment: for fp32 parameters the fragment of the weight buffer itself
  (no second copy), for bf16 ones an fp32 copy;
- the inner optimizer's state of it: the inner optimizer (torch's AdamW, fused where the device
  has the kernel, or training/lamb.py's LAMB) sees only the fragments, in the caller's
  parameter groups;
- its gradient: the fragment of the reduce-scattered fp32 gradient buffer (a view, no copy).

A step (`step()`, after the last micro-batch's backward):
1. waits for the buckets' reduce-scatters (`GradBuffer.finish`);
2. the global gradient norm from the shards: squares summed over the DP group and the
   model-parallel group, parameters replicated over TP counted on TP rank 0 only (the rule of
   DeepSpeed's), read once on the host;
3. a norm that is not finite skips the step on every rank alike (they all read the same
   reduced norm): weights, masters and optimizer state stay, `skipped_steps` counts it, the
   gradients are cleared; `overflow` says so until the next step (DeepSpeed's engine reads it
   from a client optimizer: tests/training/test_client_optimizer.py). In fp16 the gradients
   carry the loss scale (`loss_scaler`, training/loss_scale.py): the norm is divided by it,
   and the scaler learns whether the step overflowed;
4. the loss scale's removal and clipping to `clip_grad` (coefficient clip / (norm + 1e-6),
   DeepSpeed's) multiply the shards once; the inner optimizer steps the fragments;
5. the masters are written into the training-dtype weight buffer's shard, and each bucket's
   weights all-gathered over DP (asynchronously, all buckets in flight, then waited for; or,
   after `overlap_weight_gather`, left to the next step: see below);
6. the gradient buffers are zeroed.

The weights' all-gather overlapped with the next forward (`overlap_weight_gather`, as
Megatron-Core's overlap_param_gather and FSDP2's per-block unshard): the step returns with the
stepped shards written and nothing issued; `start_weight_gather()` issues every bucket's
all-gather, in forward order (the buffer's last bucket, which holds the first layers, first),
and the forward waits for a bucket only when it reaches a unit (an embedding, a Transformer
layer, the head) whose parameters lie in it: a forward pre-hook per unit, and one on the model
for parameters outside every unit. The trainer starts the gather at the beginning of the next
step, after that step's blocking collectives on the DP group (its token count) and before its
first forward; the previous step's statistics were reduced before. So no blocking collective
or host read is issued on the DP group while an all-gather on it is unwaited: NCCL runs one
communicator's operations in issue order, and such a collective would wait for every gather
(tests/training/test_issue_order.py records the order). Any wait (a unit's hook, a module's
`state_dict()`, `wait_for_weights()`, the next step, every method here that reads or writes the
weights) issues the gather first if nobody did.

LAMB's trust ratio is that of the whole parameter: the fragments' squared norms of weight and
update are summed over the DP group (and the TP group for TP-split parameters) before the
ratio (`Lamb.use_fragments`).

The state's tensors are per fragment (`fragment_states()`, `load_fragment_states()`: each rank
saves and loads its own, checkpoint/optimizer_shards.py, at any layout); `state_dict()` holds
the counters only. `full_tensors()` (a collective) gathers whole fp32 weights and optimizer
states per parameter, for checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from megatron_rembert.parallel import comm, state
from megatron_rembert.parallel.grad_buffer import Bucket, GradBuffer, weak_method
from megatron_rembert.parallel.layers import is_tp_sharded
from megatron_rembert.training.lamb import Lamb
from megatron_rembert.training.loss_scale import LossScaler

CLIP_EPS = 1e-6  # as DeepSpeed's clip_tensors_by_global_norm


@dataclass
class Fragment:
    """The part of `param` that lies in this rank's shard of `bucket`."""

    param: torch.nn.Parameter
    bucket: Bucket
    param_start: int  # first element of the fragment in the flattened parameter
    shard_start: int  # ... and in this rank's shard of the bucket
    numel: int
    master: torch.Tensor  # fp32, 1-d
    grad: torch.Tensor  # fp32, 1-d view of the gradient buffer
    weight: torch.Tensor  # 1-d view of the weight buffer (the parameter's dtype)


class DistributedOptimizer(torch.optim.Optimizer):
    """`param_groups`: torch's parameter groups of the model's parameters (every parameter of
    `buffer`, each once), with their options. `make_optimizer(groups)` builds the inner
    optimizer over the given groups of fragments, e.g.
    `lambda g: torch.optim.AdamW(g, lr=1e-3, fused=True)` or `lambda g: Lamb(g, lr=1e-3)`.
    `clip_grad`: the global norm to clip to (0: no clipping). `model_group`: the ranks of one
    model replica (TP x PP) whose norms add up (default: the parallel state's). `loss_scaler`:
    fp16's (the gradients it finds are multiplied by its scale)."""

    def __init__(self, buffer: GradBuffer, param_groups: list[dict],
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
                 clip_grad: float = 0.0, model_group=None,
                 loss_scaler: LossScaler | None = None):
        if clip_grad < 0 or not math.isfinite(clip_grad):
            raise ValueError(f"clip_grad={clip_grad}: must be a finite number >= 0")
        self.buffer, self.clip_grad, self.loss_scaler = buffer, clip_grad, loss_scaler
        parallel = state.get_state()
        self.model_group = model_group if model_group is not None else parallel.model_group
        self.tp_rank = parallel.tp_rank
        listed = [p for g in param_groups for p in g["params"]]
        if len({id(p) for p in listed}) != len(listed) or \
                {id(p) for p in listed} != {id(p) for p in buffer.params()}:
            raise ValueError("DistributedOptimizer: the parameter groups must list every "
                             "parameter of the gradient buffer exactly once")
        self.model_groups = [list(g["params"]) for g in param_groups]
        self.fragments: list[list[Fragment]] = [
            [f for p in g["params"] if (f := self._fragment(p)) is not None]
            for g in param_groups]
        master_groups = [{**{k: v for k, v in g.items() if k != "params"},
                          "params": [f.master for f in frags]}
                         for g, frags in zip(param_groups, self.fragments, strict=True)]
        super().__init__(master_groups, defaults={})
        # The inner optimizer shares our group dicts: a scheduler's lr reaches it.
        self.inner = make_optimizer(self.param_groups)
        if [id(g) for g in self.inner.param_groups] != [id(g) for g in self.param_groups]:
            raise ValueError("make_optimizer must build its optimizer over the groups given")
        self.state = self.inner.state
        if isinstance(self.inner, Lamb):
            index = [{id(p): i for i, p in enumerate(ps)} for ps in self.model_groups]
            self.inner.use_fragments(
                [([index[k][id(f.param)] for f in frags], [is_tp_sharded(p) for p in ps])
                 for k, (frags, ps) in enumerate(zip(self.fragments, self.model_groups,
                                                     strict=True))],
                buffer.dp_group if buffer.dp > 1 else None)
        self.skipped_steps = 0
        self.steps = 0
        self.grad_norm: float | None = None  # of the last step (inf or nan when skipped)
        # Whether the last step was skipped: the attribute DeepSpeed's engine reads after a
        # client optimizer's step() (then it counts a skipped step and leaves the LR schedule)
        self.overflow = False
        self.defer_gather = False  # overlap_weight_gather() was called
        self._published = False  # stepped shards written, their all-gather not issued yet
        self._gathering: dict[int, object] = {}  # bucket index -> its all-gather in flight

    def _fragment(self, param: torch.nn.Parameter) -> Fragment | None:
        bucket, offset = self.buffer.offset(param)
        lo, hi = bucket.shard_range(self.buffer.dp_rank, self.buffer.dp)
        start, end = max(lo, offset), min(hi, offset + param.numel())
        if start >= end:
            return None
        weight = bucket.weights[start:end]
        master = weight if weight.dtype == torch.float32 else weight.float()
        return Fragment(param, bucket, start - offset, start - lo, end - start, master,
                        bucket.grads[start:end], weight)

    def all_fragments(self) -> list[Fragment]:
        return [f for frags in self.fragments for f in frags]

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def norm(self) -> torch.Tensor:
        """The whole model's gradient norm from the reduced shards (fp32, 1 element)."""
        squares = torch.zeros(1, dtype=torch.float32, device=comm.device())
        counted = [f.grad for f in self.all_fragments()
                   if self.tp_rank == 0 or is_tp_sharded(f.param)]
        if counted:
            squares += torch.stack(torch._foreach_norm(counted)).float().square().sum()
        if self.buffer.dp > 1:
            comm.all_reduce(squares, group=self.buffer.dp_group)
        if self.model_group is not None:
            comm.all_reduce(squares, group=self.model_group)
        return squares.sqrt()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("DistributedOptimizer.step takes no closure")
        self.wait_for_weights()
        self.buffer.finish()
        scale = self.loss_scale
        norm = float(self.norm()) / scale  # the step's one host read
        self.grad_norm = norm
        self.overflow = not math.isfinite(norm)
        if self.loss_scaler is not None:  # every rank read the same norm: the same decision
            self.loss_scaler.update(self.overflow)
        if self.overflow:  # ... and all skip
            self.skipped_steps += 1
            self.buffer.zero()
            return None
        coef = 1.0 / scale
        if self.clip_grad > 0:
            coef *= min(1.0, self.clip_grad / (norm + CLIP_EPS))
        if coef != 1.0:
            for bucket in self.buffer.buckets:
                self.buffer.shard(bucket).mul_(coef)
        for f in self.all_fragments():
            f.master.grad = f.grad
        self.inner.step()
        for f in self.all_fragments():
            f.master.grad = None
        self._publish(wait=not self.defer_gather)
        self.buffer.zero()
        self.steps += 1
        return None

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (1 outside fp16)."""
        return self.loss_scaler.cur_scale if self.loss_scaler is not None else 1.0

    def _publish(self, wait: bool = True) -> None:
        """Masters -> this rank's weight shards; then every rank's weights, gathered now
        (`wait`) or left to `start_weight_gather` (or the first wait)."""
        self.wait_for_weights()
        for f in self.all_fragments():
            if f.master is not f.weight:
                f.weight.copy_(f.master)
        self._published = self.buffer.dp > 1
        if wait:
            self.wait_for_weights()

    # -- the weights' all-gather overlapped with the next forward ---------------------------------
    def start_weight_gather(self) -> None:
        """Issue the all-gathers of the weights the last step stepped, every bucket in forward
        order (the last bucket first), and leave them in flight; nothing if none is due."""
        if not self._published:
            return
        self._published = False
        for b in reversed(self.buffer.buckets):
            self._gathering[b.index] = comm.all_gather_into(
                b.weights, self.buffer.shard(b, grads=False), self.buffer.dp_group,
                async_op=True)

    def wait_for_weights(self, buckets: Iterable[int] | None = None) -> None:
        """Wait for the weights' all-gathers (issued first if they are due): of the given
        bucket indices, or all."""
        self.start_weight_gather()
        for index in list(self._gathering) if buckets is None else buckets:
            handle = self._gathering.pop(index, None)
            if handle is not None:
                comm.wait(handle)

    @property
    def gathering(self) -> list[int]:
        """Indices of the buckets whose weights' all-gather is still in flight."""
        return sorted(self._gathering)

    def overlap_weight_gather(self, model: torch.nn.Module,
                              units: tuple[type[torch.nn.Module], ...]) -> None:
        """From the next step on, leave the weights' all-gathers to `start_weight_gather`: each
        module of `model` that is an instance of `units` waits, before its forward, for the
        buckets of its parameters (its submodules' included), and `model` itself for those of
        the parameters outside every unit. Every module's `state_dict()` waits for all. A unit
        must use no parameter outside itself in its forward; a parameter shared by two units
        is waited for by both."""
        in_buffer = {id(p) for p in self.buffer.params()}
        covered: set[int] = set()
        self._weight_hooks = []
        wait_for = weak_method(self.wait_for_weights)
        for module in model.modules():
            if isinstance(module, units) and module is not model:
                own = [p for p in module.parameters() if id(p) in in_buffer]
                covered.update(id(p) for p in own)
                self._weight_hooks.append(self._wait_before_forward(module, own, wait_for))
        rest = [p for p in model.parameters() if id(p) in in_buffer and id(p) not in covered]
        self._weight_hooks.append(self._wait_before_forward(model, rest, wait_for))
        for module in model.modules():
            self._weight_hooks.append(module.register_state_dict_pre_hook(
                lambda *_: wait_for(None)))
        self.defer_gather = True

    def _wait_before_forward(self, module: torch.nn.Module, params: list, wait_for):
        buckets = sorted({self.buffer.offset(p)[0].index for p in params})
        return module.register_forward_pre_hook(lambda *_: wait_for(buckets))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; nothing to do right after a step (it cleared them), which is
        when DeepSpeed's engine calls this."""
        if not self.buffer.clean:
            self.buffer.zero()

    # -- state -----------------------------------------------------------------------------------
    def _layout(self) -> dict:
        return {"dp": self.buffer.dp, "dp_rank": self.buffer.dp_rank,
                "buckets": [[b.numel, [p.numel() for p in b.params]]
                            for b in self.buffer.buckets]}

    def state_dict(self) -> dict:
        """The counters and the layout. The tensors of the state (masters, the inner
        optimizer's moments) are this rank's fragments, saved by each rank itself
        (`fragment_states`, checkpoint/optimizer_shards.py): what DeepSpeed's engine saves of
        a client optimizer (from one DP rank only) is this."""
        return {"layout": self._layout(), "steps": self.steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict) -> None:
        """The counters of `state_dict()`; the tensors come with `load_fragment_states`."""
        self.steps, self.skipped_steps = state_dict["steps"], state_dict["skipped_steps"]

    # -- fragments, for a checkpoint readable at another layout (checkpoint/optimizer_shards.py)
    def fragment_states(self) -> tuple[list[dict[str, torch.Tensor]], int]:
        """Per fragment (in `all_fragments()` order) its fp32 master and the inner optimizer's
        state tensors of its shape (`exp_avg`, `exp_avg_sq`), and the inner optimizer's step
        count (0 before its first step)."""
        out, inner_step = [], 0
        for f in self.all_fragments():
            saved = self.inner.state.get(f.master, {})
            tensors = {"master": f.master}
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and value.shape == f.master.shape:
                    tensors[key] = value
                elif key == "step":
                    inner_step = int(value)
            out.append(tensors)
        return out, inner_step

    @torch.no_grad()
    def load_fragment_states(self, states: Iterable[dict[str, torch.Tensor]],
                             inner_step: int, steps: int, skipped_steps: int) -> None:
        """Put `fragment_states()`-shaped tensors (read for this rank's fragments, whatever
        layout saved them; a list, or an iterator that reads each when it is reached) into
        the masters and the inner optimizer (through its public `load_state_dict`), then
        refresh the weights on every rank (a collective)."""
        self.wait_for_weights()
        frags = self.all_fragments()
        moments, remaining = [], iter(states)
        for f, tensors in zip(frags, remaining, strict=False):  # the count is checked below
            if tensors["master"] is not f.master:  # a reader may have read it into place
                f.master.copy_(tensors["master"])
            moments.append({k: v for k, v in tensors.items() if k != "master"})
        if len(moments) != len(frags) or next(remaining, None) is not None:
            raise ValueError(f"the fragment states do not match the {len(frags)} fragments")
        saved = self.inner.state_dict()
        if inner_step > 0:
            index = {id(p): i for i, p in enumerate(
                p for g in self.inner.param_groups for p in g["params"])}
            saved["state"] = {index[id(f.master)]: {"step": torch.tensor(float(inner_step)),
                                                    **moment}
                              for f, moment in zip(frags, moments, strict=True)}
        self.inner.load_state_dict(saved)
        # torch's load_state_dict gives the inner optimizer new group dicts: share them again,
        # or a scheduler's lr (set on ours) would never reach it
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.steps, self.skipped_steps = steps, skipped_steps
        self._publish()

    @torch.no_grad()
    def full_tensors(self) -> dict:
        """Every parameter's whole fp32 weight and optimizer state tensors (a collective):
        {"weights": [...], "state": {name: [...]}, "steps": n}, lists in the order of the
        parameter groups' parameters."""
        self.wait_for_weights()
        frags = self.all_fragments()
        keys = sorted({k for f in frags for k, v in self.inner.state.get(f.master, {}).items()
                       if isinstance(v, torch.Tensor) and v.shape == f.master.shape})
        keys = self._agreed_keys(keys)
        out = {"weights": self._gather(lambda f: f.master)}
        out["state"] = {k: self._gather(lambda f, k=k: self.inner.state[f.master][k])
                        for k in keys}
        out["steps"] = self.steps
        return out

    def _agreed_keys(self, keys: list[str]) -> list[str]:
        """The state names some rank has (a rank without fragments has none)."""
        names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        have = [float(k in keys) for k in names]
        if self.buffer.dp > 1:
            have = comm.all_reduce_values(have, group=self.buffer.dp_group)
        return [k for k, n in zip(names, have, strict=True) if n > 0]

    def _gather(self, of: Callable[[Fragment], torch.Tensor]) -> list[torch.Tensor]:
        by_bucket: dict[int, torch.Tensor] = {}
        for bucket in self.buffer.buckets:
            shard = torch.zeros(bucket.numel // self.buffer.dp, dtype=torch.float32,
                                device=bucket.grads.device)
            for f in self.all_fragments():
                if f.bucket is bucket:
                    shard[f.shard_start:f.shard_start + f.numel] = of(f)
            full = torch.empty(bucket.numel, dtype=torch.float32, device=shard.device)
            comm.all_gather_into(full, shard, self.buffer.dp_group)
            by_bucket[bucket.index] = full
        out = []
        for params in self.model_groups:
            for p in params:
                bucket, offset = self.buffer.offset(p)
                out.append(by_bucket[bucket.index][offset:offset + p.numel()].view(p.shape)
                           .clone())
        return out
