"""training/distributed_optimizer.py's state on disk, one file per rank, read at any DP size.

Each rank writes the fragments it owns (the parts of parameters that fall into its shards of
the gradient buckets) into `optim_tp{t}_pp{p}_dp{d}.safetensors`, one tensor per fragment and
kind, named by the parameter and the element range it covers in the flattened parameter:

    master/NAME@LO:HI       fp32 master weights
    exp_avg/NAME@LO:HI      the inner optimizer's state of the same elements
    exp_avg_sq/NAME@LO:HI

and in the header's metadata the format, the step counts (`steps`, `skipped_steps`, the inner
optimizer's `inner_step`) and the DP size that wrote it. Nothing is gathered and nothing is
pickled: a save costs each rank its own bytes, and a reader maps only the slices it needs.

A reader at any DP size (the same TP and PP: NAME is the TP-local parameter) opens every file
of its TP and PP rank, and assembles each of its own fragments from the saved ranges that
overlap it; a range that no file covers is an error naming the parameter. Files are found by
their own name pattern inside the step folder only.

This is the first part of the checkpoint the trainer will write once it steps our optimizer
(the issue "Own the data-parallel gradient path"); the trainer does not write it yet.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from megatron_rembert.checkpoint import CheckpointError
from megatron_rembert.checkpoint.files import SafetensorsWriter, safe_open_checked

FORMAT = "megatron-rembert-optimizer-shards-v1"
_FILE = re.compile(r"optim_tp(\d{2})_pp(\d{3})_dp(\d{3,})\.safetensors")
_KEY = re.compile(r"([a-z_]+)/(.+)@(\d+):(\d+)")


def shard_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"optim_tp{tp_rank:02d}_pp{pp_rank:03d}_dp{dp_rank:03d}.safetensors"


def save(optimizer, names: dict[int, str], folder: str | Path, tp_rank: int = 0,
         pp_rank: int = 0) -> dict:
    """Write this rank's file into `folder`; returns its manifest record (size, sha256).
    `names`: id(parameter) -> its name (the model's `named_parameters()`)."""
    states, inner_step = optimizer.fragment_states()
    items = []
    for f, tensors in zip(optimizer.all_fragments(), states, strict=True):
        name = names.get(id(f.param))
        if name is None:
            raise CheckpointError(f"{folder}: a parameter of shape {tuple(f.param.shape)} has "
                                  "no name (give every model parameter)")
        span = f"{f.param_start}:{f.param_start + f.numel}"
        items += [(f"{kind}/{name}@{span}", t.detach().float()) for kind, t in tensors.items()]
    meta = {"format": FORMAT, "steps": str(optimizer.steps),
            "skipped_steps": str(optimizer.skipped_steps), "inner_step": str(inner_step),
            "dp": str(optimizer.buffer.dp)}
    path = Path(folder) / shard_file(tp_rank, pp_rank, optimizer.buffer.dp_rank)
    with SafetensorsWriter(path, [(k, t.dtype, tuple(t.shape)) for k, t in items],
                           metadata=meta) as writer:
        for key, tensor in items:
            writer.write(key, tensor)
    return writer.record()


def load(optimizer, names: dict[int, str], folder: str | Path, tp_rank: int = 0,
         pp_rank: int = 0) -> None:
    """Fill this rank's fragments from every file of its TP and PP rank in `folder`, whatever
    DP size wrote them; every rank calls it (the weights are refreshed with a collective)."""
    folder = Path(folder)
    files = sorted(p for p in folder.iterdir() if p.is_file() and (m := _FILE.fullmatch(p.name))
                   and (int(m[1]), int(m[2])) == (tp_rank, pp_rank))
    if not files:
        raise CheckpointError(f"{folder}: no optimizer shard of TP rank {tp_rank}, PP rank "
                              f"{pp_rank} ({shard_file(tp_rank, pp_rank, 0)} and the other DP "
                              "ranks'); was it saved at another TP or PP size?")
    with _Saved(files) as saved:
        states = []
        for f in optimizer.all_fragments():
            name = names[id(f.param)]
            lo, hi = f.param_start, f.param_start + f.numel
            states.append({kind: saved.read(kind, name, lo, hi) for kind in saved.kinds})
        meta = saved.meta
    optimizer.load_fragment_states(states, int(meta["inner_step"]), int(meta["steps"]),
                                   int(meta["skipped_steps"]))


class _Saved:
    """The saved fragments of a set of files: (kind, name) -> [(lo, hi, handle, key)]."""

    def __init__(self, files: list[Path]):
        self.files, self._stack = files, []
        self.ranges: dict[tuple[str, str], list[tuple[int, int, object, str]]] = {}
        self.kinds: set[str] = set()
        self.meta: dict[str, str] = {}

    def __enter__(self) -> _Saved:
        for path in self.files:
            ctx = safe_open_checked(path)
            handle = ctx.__enter__()
            self._stack.append(ctx)
            meta = handle.metadata() or {}
            if meta.get("format") != FORMAT:
                raise CheckpointError(f"{path}: not an optimizer shard of {FORMAT} "
                                      f"(format {meta.get('format')!r})")
            agreed = {k: meta.get(k) for k in ("steps", "skipped_steps", "inner_step", "dp")}
            if self.meta and agreed != self.meta:
                raise CheckpointError(f"{path}: its step counts or DP size {agreed} differ "
                                      f"from {self.files[0]}'s {self.meta}")
            self.meta = agreed
            for key in handle.keys():
                m = _KEY.fullmatch(key)
                if m is None:
                    raise CheckpointError(f"{path}: unexpected tensor {key!r}")
                kind, name, lo, hi = m[1], m[2], int(m[3]), int(m[4])
                self.kinds.add(kind)
                self.ranges.setdefault((kind, name), []).append((lo, hi, handle, key))
        if len(self.files) != int(self.meta["dp"]):
            raise CheckpointError(f"{self.files[0].parent}: {len(self.files)} optimizer shard "
                                  f"files of this TP and PP rank, written at DP size "
                                  f"{self.meta['dp']}: the checkpoint is incomplete")
        return self

    def __exit__(self, *exc) -> None:
        for ctx in reversed(self._stack):
            ctx.__exit__(None, None, None)

    def read(self, kind: str, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the flattened `name` of `kind`, from the overlapping ranges."""
        out = torch.empty(hi - lo, dtype=torch.float32)
        covered = 0
        for start, end, handle, key in self.ranges.get((kind, name), []):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                out[a - lo:b - lo] = handle.get_slice(key)[a - start:b - start]
                covered += b - a
        if covered != hi - lo:
            raise CheckpointError(f"{self.files[0].parent}: {kind} of {name}, elements "
                                  f"{lo}:{hi}: only {covered} of {hi - lo} are in the saved "
                                  "shards")
        return out
