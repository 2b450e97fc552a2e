"""fp32 main gradients in contiguous buffers, reduce-scattered over data parallelism in buckets
while backward is still running.

Layout (one buffer pair per parameter dtype, in the order the dtypes first appear):
- the parameters in reverse registration order (backward produces the last layers' gradients
  first), each starting at a multiple of `ALIGN` elements;
- cut into buckets of at least `bucket_elements` elements (a parameter is never split), each
  padded to a multiple of dp x `ALIGN`, so that it splits into dp equal shards: DP rank r owns
  shard r of every bucket (training/distributed_optimizer.py steps it);
- an fp32 gradient buffer, each parameter's `main_grad` a view of it, and a weight buffer of the
  parameter's dtype, each parameter's `.data` a view of it (the optimizer's all-gather writes
  the stepped weights straight into the parameters).

Accumulation: for every parameter a post-accumulate-grad hook (torch's public
`register_post_accumulate_grad_hook`) adds `param.grad` into `main_grad` and frees it. The
parameters declared `summed_by_kernels` are the exception: their kernels (kernels/embedding.py,
the fused MLM loss of kernels/cross_entropy.py) add into `param.main_grad` themselves, hand
autograd no gradient, and call `param.main_grad_added()` when a backward pass has added its
part; the layers use those kernels only for a parameter that has `main_grad_added`. That call,
not autograd, tells the buffer such a gradient is in: whether AccumulateGrad runs the hook for
an undefined gradient differs between torch versions, so a hook that finds no gradient counts
for nothing, and one that finds a gradient on a kernel-summed parameter is an error (it would
bypass the count).

Reduction: `expect(passes)` before the first of the step's backward passes (its micro-batches on
this rank; at pp > 1 those the pipeline schedule runs on this stage) arms it. From then on a
parameter is ready when its hook has run once per pass, and a bucket whose parameters are all
ready starts its reduce-scatter at once, asynchronously, while the last backward goes on with
earlier layers: no hook into the schedule is needed to know which backward is the last. Buckets
start in index order on every rank (a bucket completed early waits for the ones before it), so
the ranks issue the same collectives in the same order whatever order their hooks ran in. A
parameter that got no gradient in the whole previous step (one that takes no part in the model's
forward) counts as ready from the start, so that it holds back no bucket; should it get a
gradient after its bucket started, the step fails naming it (that gradient would be lost). A
parameter whose hook ran in fewer passes than expected holds its bucket until `finish()`.
`finish()` starts what is left (in the first step: the buckets of unused parameters and all
after them) and waits; afterwards shard r of each bucket holds the sum (or mean) over the DP
ranks. The rest of a bucket is not reduced; `zero()` clears everything for the next step.

On the wire (`wire_dtype`): fp32, a reduce-scatter of the fp32 bucket; or bf16, Megatron-Core's
reduce-scatter with fp32 accumulation: the bucket rounded to bf16 once, an all-to-all that
brings every rank's bf16 copy of shard r to rank r, summed there in fp32 in rank order (each
rank's gradient rounded once, the sum exact to fp32; (n-1)/n x 2 bytes per element instead
of 4, and a bf16 copy plus a bf16 receive buffer per bucket in flight).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from megatron_rembert.parallel import comm

ALIGN = 64  # elements: where each parameter starts, and the unit of a bucket's padding
DEFAULT_BUCKET_ELEMENTS = 40_000_000  # Megatron-Core's default bucket size
REDUCE_OPS = ("sum", "mean")
WIRE_DTYPES = (torch.float32, torch.bfloat16)


def lay_out(sizes: list[int], bucket_elements: int, dp: int
            ) -> tuple[list[int], list[tuple[int, int, int, int]]]:
    """Where parameters of `sizes` elements (in buffer order) start, and the buckets: per
    bucket (first parameter, one past its last, start, end), as GradBuffer lays them out.
    Also what training/communication.py counts the DP collectives by."""
    starts: list[int] = []
    bounds: list[tuple[int, int, int, int]] = []
    first = bucket_start = offset = 0
    for i, size in enumerate(sizes):
        offset = _round_up(offset, ALIGN)
        starts.append(offset)
        offset += size
        if offset - bucket_start >= bucket_elements or i == len(sizes) - 1:
            end = bucket_start + _round_up(offset - bucket_start, dp * ALIGN)
            bounds.append((first, i + 1, bucket_start, end))
            first, bucket_start, offset = i + 1, end, end
    return starts, bounds


class ForeignGradient(RuntimeError):
    """A parameter of the buffer got a gradient outside it."""


def weak_method(method):
    """`method` of an object, called only while the object lives."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def _weak_call(call, param):
    """`call(param)` as a function of no arguments that holds `param` weakly (the parameter
    carries it)."""
    ref = weakref.ref(param)

    def added() -> None:
        p = ref()
        if p is not None:
            call(p)

    return added


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class Bucket:
    """A contiguous range [start, end) of one dtype group's buffers."""

    index: int  # position in GradBuffer.buckets (the order reduce-scatters start in)
    params: list[torch.nn.Parameter]
    start: int
    end: int  # padded: (end - start) is a multiple of dp x ALIGN
    grads: torch.Tensor  # fp32 view of the group's gradient buffer
    weights: torch.Tensor  # view of the group's weight buffer (the parameters' dtype)
    ready: set[int] = field(default_factory=set)  # ids of the parameters ready this step
    handle: object = None  # the reduce-scatter in flight

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, rank: int, dp: int) -> tuple[int, int]:
        """Elements [lo, hi) of the bucket (relative to its start) that DP rank `rank` owns."""
        size = self.numel // dp
        return rank * size, (rank + 1) * size

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)


@dataclass
class DtypeGroup:
    dtype: torch.dtype
    grads: torch.Tensor  # fp32, every bucket of this dtype, padding included
    weights: torch.Tensor  # the parameters' dtype, same layout
    buckets: list[Bucket]


class GradBuffer:
    """Gradient buffers of `params` (those that require a gradient), reduced over `dp_group`
    (default: the parallel state's DP group; None without one: every rank of the world).
    `summed_by_kernels`: the parameters whose kernels add their gradient themselves, each as
    often as kernels add into it per backward pass (see the module docstring).

    reduce: "sum" (the loss is scaled for the global batch already) or "mean" (the DP
    ranks' gradients are averaged)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], dp_group=None,
                 bucket_elements: int = DEFAULT_BUCKET_ELEMENTS, reduce: str = "sum",
                 wire_dtype: torch.dtype = torch.float32,
                 summed_by_kernels: Iterable[torch.nn.Parameter] = ()):
        if reduce not in REDUCE_OPS:
            raise ValueError(f"reduce={reduce!r}: one of {', '.join(REDUCE_OPS)}")
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype={wire_dtype}: one of {WIRE_DTYPES}")
        self.wire_dtype = wire_dtype
        if bucket_elements < 1:
            raise ValueError(f"bucket_elements={bucket_elements}: must be >= 1")
        if dp_group is None:
            from megatron_rembert.parallel import state

            dp_group = state.get_state().dp_group
        self.dp_group, self.reduce = dp_group, reduce
        self.dp = comm.group_size(dp_group)
        self.dp_rank = comm.group_rank(dp_group)
        self.bucket_elements = bucket_elements
        unique: dict[int, torch.nn.Parameter] = {}
        for p in params:
            if p.requires_grad:
                unique.setdefault(id(p), p)
        if not unique:
            raise ValueError("GradBuffer: no parameter requires a gradient")
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in unique.values():
            by_dtype.setdefault(p.dtype, []).append(p)
        self.groups: list[DtypeGroup] = []
        self.buckets: list[Bucket] = []
        self.ranges: dict[int, tuple[DtypeGroup, Bucket, int]] = {}  # id -> where it starts
        for dtype, group_params in by_dtype.items():
            self.groups.append(self._lay_out(dtype, group_params[::-1]))
        # The hooks reach this buffer through a weak reference: a parameter's hook holding the
        # buffer would keep the buffers (every weight and gradient) alive after the model and
        # the trainer are gone.
        on_grad = weak_method(self._on_grad)
        self._hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in unique.values()]
        # parameter id -> the kernel calls that add its gradient in one backward pass (two for
        # a table tied between the input embedding and the output projection)
        self._kernel_calls: dict[int, int] = {}
        for p in summed_by_kernels:
            if id(p) not in unique:
                raise ValueError("GradBuffer: a parameter summed by kernels must be one of the "
                                 "buffer's parameters that require a gradient")
            self._kernel_calls[id(p)] = self._kernel_calls.get(id(p), 0) + 1
            p.main_grad_added = _weak_call(weak_method(self._on_kernel_added), p)
        self._kernel_left: dict[int, int] = {}  # calls still to come in this backward pass
        self._armed = False
        self._passes_left: dict[int, int] = {}  # per parameter: backward passes still to come
        self._next = 0  # the next bucket to start
        self._used: set[int] = set()  # parameters whose hook ran in this step
        self._unused: set[int] = set()  # parameters that got no gradient in the previous step
        self._names = {id(p): f"parameter {i} ({tuple(p.shape)})"
                       for i, p in enumerate(unique.values())}
        self.started_in_finish = 0  # buckets of the last step started by finish(), not backward
        self.clean = True  # nothing accumulated since the last zero()

    # -- layout ------------------------------------------------------------------------------
    def _lay_out(self, dtype: torch.dtype, params: list[torch.nn.Parameter]) -> DtypeGroup:
        starts, bounds = lay_out([p.numel() for p in params], self.bucket_elements, self.dp)
        offsets = {id(p): start for p, start in zip(params, starts, strict=True)}
        spans = [(params[first:last], start, end) for first, last, start, end in bounds]
        total = spans[-1][2]
        device = params[0].device
        grads = torch.zeros(total, dtype=torch.float32, device=device)
        weights = torch.zeros(total, dtype=dtype, device=device)
        group = DtypeGroup(dtype, grads, weights, [])
        for members, start, end in spans:
            bucket = Bucket(len(self.buckets), members, start, end, grads[start:end],
                            weights[start:end])
            group.buckets.append(bucket)
            self.buckets.append(bucket)
            for p in members:
                lo = offsets[id(p)]
                view = weights[lo:lo + p.numel()].view(p.shape)
                view.copy_(p.detach())
                p.data = view
                p.main_grad = grads[lo:lo + p.numel()].view(p.shape)
                self.ranges[id(p)] = (group, bucket, lo)
        return group

    def params(self) -> list[torch.nn.Parameter]:
        """Every parameter, in buffer order."""
        return [p for b in self.buckets for p in b.params]

    def offset(self, param: torch.nn.Parameter) -> tuple[Bucket, int]:
        """`param`'s bucket and where it starts in that bucket (elements)."""
        _, bucket, lo = self.ranges[id(param)]
        return bucket, lo - bucket.start

    # -- accumulation and reduction ------------------------------------------------------------
    def name(self, param: torch.nn.Parameter, name: str) -> None:
        """How errors call `param` (its name in the model)."""
        self._names[id(param)] = name

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        """autograd's post-accumulate hook: the pass's gradient of `param` is in `.grad`."""
        if param.grad is None:  # some torch versions call it for an undefined gradient
            return
        if id(param) in self._kernel_calls:
            raise RuntimeError(f"{self._names[id(param)]} is summed into its main gradient by "
                               "kernels, yet autograd handed it a gradient: it would reach "
                               "its bucket without being counted")
        self._arrived(param)
        param.main_grad.add_(param.grad)
        param.grad = None
        self._counted(param)

    def _on_kernel_added(self, param: torch.nn.Parameter) -> None:
        """A kernel added its part of a backward pass into `param.main_grad`."""
        self._arrived(param)
        left = self._kernel_left.get(id(param), self._kernel_calls[id(param)]) - 1
        if left > 0:
            self._kernel_left[id(param)] = left
            return
        self._kernel_left.pop(id(param), None)
        self._counted(param)

    def _arrived(self, param: torch.nn.Parameter) -> None:
        self._used.add(id(param))
        self.clean = False
        if self._armed and id(param) in self._unused:
            _, bucket, _ = self.ranges[id(param)]
            if bucket.index < self._next:
                raise RuntimeError(
                    f"{self._names[id(param)]} got a gradient after its bucket's "
                    "reduce-scatter started: it had none in the previous step. Set "
                    "requires_grad=False on parameters the model does not always use")

    def _counted(self, param: torch.nn.Parameter) -> None:
        """One backward pass's gradient of `param` is complete."""
        if self._armed:
            left = self._passes_left.get(id(param), 0) - 1
            self._passes_left[id(param)] = left
            if left == 0:
                self._ready(param)

    def expect(self, passes: int) -> None:
        """This step's gradients come from the next `passes` backward passes: each bucket's
        reduce-scatter starts as soon as its parameters' hooks have run that many times (during
        the last pass). `expect(1)` before the last micro-batch does the same."""
        if passes < 1:
            raise ValueError(f"passes={passes}: must be >= 1")
        for b in self.buckets:
            b.ready.clear()
        self._next = 0
        self._armed = True
        self._passes_left = {i: passes for i in self.ranges if i not in self._unused}
        for b in self.buckets:
            b.ready.update(i for i in self._unused if self.ranges[i][1] is b)
        self._advance()

    def _ready(self, param: torch.nn.Parameter) -> None:
        """`param`'s gradient of this step is complete."""
        _, bucket, _ = self.ranges[id(param)]
        bucket.ready.add(id(param))
        self._advance()

    def _advance(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._start(self.buckets[self._next])
            self._next += 1

    def _start(self, bucket: Bucket) -> None:
        if self.dp == 1:
            return
        lo, hi = bucket.shard_range(self.dp_rank, self.dp)
        shard = bucket.grads[lo:hi]
        if self.wire_dtype == torch.float32:
            bucket.handle = comm.reduce_scatter(shard, bucket.grads, self.dp_group,
                                                async_op=True)
            return
        sent = bucket.grads.to(self.wire_dtype)
        received = torch.empty_like(sent)  # chunk i: rank i's copy of this rank's shard

        def add_up() -> None:
            torch.sum(received.view(self.dp, -1), dim=0, dtype=torch.float32, out=shard)

        work = comm.all_to_all(received, sent, self.dp_group, async_op=True)
        bucket.handle = comm.Then(work, add_up, keep=(sent, received))

    def finish(self) -> None:
        """Start what has not started, in order, and wait for every bucket: this rank's
        shards hold the reduced gradients. Fails (ForeignGradient) if a parameter holds a
        `.grad`: the hooks free every gradient they add, so one left there came another way
        (an engine's own gradient reduction fills every parameter's) and is not in the
        buffers."""
        foreign = [self._names[id(p)] for p in self.params() if p.grad is not None]
        if foreign:
            raise ForeignGradient(
                f"{foreign[0]} (and {len(foreign) - 1} more) hold a .grad when the step "
                "reduces the gradient buffers: something other than the buffer's hooks "
                "produced it (an engine's own gradient reduction fills every parameter's), "
                "and the buffers' reduction would leave it out")
        start = self._next if self._armed else 0
        self.started_in_finish = len(self.buckets) - start
        for b in self.buckets[start:]:
            self._start(b)
        self._armed = False
        self._next = len(self.buckets)
        self._unused = set(self.ranges) - self._used
        self._used.clear()
        for b in self.buckets:
            if b.handle is not None:
                comm.wait(b.handle)
                b.handle = None
            if self.reduce == "mean" and self.dp > 1:
                lo, hi = b.shard_range(self.dp_rank, self.dp)
                b.grads[lo:hi].div_(self.dp)

    def shard(self, bucket: Bucket, grads: bool = True) -> torch.Tensor:
        """This rank's shard of `bucket`'s gradients (or weights)."""
        lo, hi = bucket.shard_range(self.dp_rank, self.dp)
        return (bucket.grads if grads else bucket.weights)[lo:hi]

    def zero(self) -> None:
        """Clear the gradients for the next step."""
        for g in self.groups:
            g.grads.zero_()
        for p in self.params():
            p.grad = None
        self._kernel_left.clear()
        self.clean = True

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self.params():
            if id(p) in self._kernel_calls:
                del p.main_grad_added

    @property
    def padding(self) -> int:
        """Elements of the buffers that belong to no parameter (alignment, bucket padding)."""
        return sum(g.grads.numel() for g in self.groups) - sum(p.numel() for p in self.params())
