"""training/distributed_optimizer.py's state on disk, one file per rank, read at any layout.

Each rank writes the fragments it owns (the parts of parameters that fall into its shards of
the gradient buckets) into `optim_tp{t}_pp{p}_dp{d}.safetensors`, one tensor per fragment and
kind, named by the parameter's global name (checkpoint/specs.py, the same at every TP and PP
size) and the element range it covers in this rank's flattened TP shard of it:

    master/NAME@LO:HI       fp32 master weights
    exp_avg/NAME@LO:HI      the inner optimizer's state of the same elements
    exp_avg_sq/NAME@LO:HI

and in the header's metadata the format, the step counts (`steps`, `skipped_steps`, the inner
optimizer's `inner_step`), the layout that wrote it (tp, pp, dp) and the TP-shard shape of each
parameter it holds. Nothing is gathered and nothing is pickled: a save costs each rank its own
bytes, and a reader maps only the slices it needs.

A reader at any TP x PP x DP layout opens every shard file of the step folder (found by their
name pattern inside the folder only; as many as the writing layout had ranks) and assembles
each of its own fragments: at the writer's TP size (or for a parameter TP does not split)
straight from the saved ranges that overlap it; at another TP size from the parameter's full
tensor, merged from the writer's TP shards and cut for this rank (`specs.merge_shards` and
`specs.shard`, vocabulary padding stripped and zero-filled). A range that no file covers is an
error naming the parameter.

On the trainer's production path these files are the checkpoint's tensors (the masters are
the weights of record; training/checkpoint.py). tests/checkpoint/test_optimizer_shards.py
changes DP and TP sizes between save and resume; tests/convert/test_every_checkpoint.py and
tests/training/test_layouts.py resume the trainer's at other TP, PP and DP sizes.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rembert.checkpoint import CheckpointError
from megatron_rembert.checkpoint.files import (
    ST_DTYPES,
    SafetensorsWriter,
    StoredTensor,
    safe_open_checked,
)
from megatron_rembert.checkpoint.specs import ParamSpec, merge_shards, shard

FORMAT = "megatron-rembert-optimizer-shards-v1"
_FILE = re.compile(r"optim_tp(\d{2})_pp(\d{3})_dp(\d{3,})\.safetensors")
_KEY = re.compile(r"([a-z_]+)/(.+)@(\d+):(\d+)")
_AGREED = ("format", "steps", "skipped_steps", "inner_step", "layout")


def _dtype_name(handle, key: str) -> str:
    """A stored tensor's dtype in torch's spelling (safetensors' own for types torch lacks)."""
    names = {st: str(dt).removeprefix("torch.") for dt, st in ST_DTYPES.items()}
    dtype = handle.get_slice(key).get_dtype()
    return names.get(dtype, dtype)


def shard_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"optim_tp{tp_rank:02d}_pp{pp_rank:03d}_dp{dp_rank:03d}.safetensors"


@dataclass
class Collected:
    """One rank's shard file, collected: its name, its tensors and header metadata."""

    name: str
    items: list[tuple[str, torch.Tensor]]
    meta: dict[str, str]


@dataclass
class Piece:
    """A run of one parameter's elements that this rank saves: `param`, the first element in
    its flattened TP shard, how many, and its fp32 tensors by kind (`master`, the inner
    optimizer's moments), each 1-d of `numel` elements."""

    param: torch.Tensor
    start: int
    numel: int
    tensors: dict[str, torch.Tensor]


def collect(optimizer, specs: dict[int, ParamSpec], *, tp: int = 1, tp_rank: int = 0,
            pp: int = 1, pp_rank: int = 0, copy: bool = False) -> Collected:
    """This rank's fragments of our distributed optimizer and its counters. `specs`:
    id(parameter) -> its spec (`ParamSpec.of` on the model's parameters, global names).
    `copy`: host copies that later steps cannot change (for a write in the background);
    otherwise the tensors may be the live masters."""
    states, inner_step = optimizer.fragment_states()
    pieces = [Piece(f.param, f.param_start, f.numel, tensors)
              for f, tensors in zip(optimizer.all_fragments(), states, strict=True)]
    counters = {"steps": optimizer.steps, "skipped_steps": optimizer.skipped_steps,
                "inner_step": inner_step}
    return collect_pieces(pieces, specs, counters, dp=optimizer.buffer.dp,
                          dp_rank=optimizer.buffer.dp_rank, tp=tp, tp_rank=tp_rank, pp=pp,
                          pp_rank=pp_rank, copy=copy)


def collect_pieces(pieces: list[Piece], specs: dict[int, ParamSpec], counters: dict[str, int],
                   *, dp: int, dp_rank: int, tp: int, tp_rank: int, pp: int, pp_rank: int,
                   copy: bool) -> Collected:
    """This rank's shard file from the pieces it saves, whichever optimizer holds them (ours,
    or DeepSpeed's on its own path: training/deepspeed_private.py, `optimizer_pieces`).
    `counters`: steps, skipped_steps, inner_step."""
    items, shapes = [], {}
    for piece in pieces:
        spec = specs.get(id(piece.param))
        if spec is None:
            raise CheckpointError(f"a parameter of shape {tuple(piece.param.shape)} has no "
                                  "spec (give every model parameter)")
        shapes[spec.name] = list(piece.param.shape)
        span = f"{piece.start}:{piece.start + piece.numel}"
        items += [(f"{kind}/{spec.name}@{span}",
                   t.detach().to("cpu", torch.float32, copy=True) if copy else t.detach().float())
                  for kind, t in piece.tensors.items()]
    meta = {"format": FORMAT, **{k: str(int(counters[k])) for k in
                                 ("steps", "skipped_steps", "inner_step")},
            "layout": json.dumps({"tp": tp, "pp": pp, "dp": dp}), "shapes": json.dumps(shapes)}
    return Collected(shard_file(tp_rank, pp_rank, dp_rank), items, meta)


def write(collected: Collected, folder: str | Path) -> tuple[Path, dict]:
    """Write a collected shard into `folder` (fsynced); returns its path and manifest record
    (size, sha256, hashed while writing)."""
    path = Path(folder) / collected.name
    with SafetensorsWriter(path, [(k, t.dtype, tuple(t.shape)) for k, t in collected.items],
                           metadata=collected.meta) as writer:
        for key, tensor in collected.items:
            writer.write(key, tensor)
    return path, writer.record()


def save(optimizer, specs: dict[int, ParamSpec], folder: str | Path, *, tp: int = 1,
         tp_rank: int = 0, pp: int = 1, pp_rank: int = 0) -> dict:
    """`collect` and `write` this rank's file into `folder`; returns its manifest record."""
    collected = collect(optimizer, specs, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank)
    return write(collected, folder)[1]


def files_of(folder: str | Path) -> list[Path]:
    """The shard files of a step folder (by their name pattern, inside the folder only)."""
    folder = Path(folder)
    return sorted(p for p in folder.iterdir() if p.is_file() and _FILE.fullmatch(p.name))


def load(optimizer, specs: dict[int, ParamSpec], folder: str | Path, *, tp: int = 1,
         tp_rank: int = 0) -> None:
    """Fill this rank's fragments (it runs at TP size `tp`) from the shard files in `folder`,
    whatever layout wrote them; every rank calls it (the weights are refreshed with a
    collective)."""
    folder = Path(folder)
    files = files_of(folder)
    if not files:
        raise CheckpointError(f"{folder}: no optimizer shard ({shard_file(0, 0, 0)} and the "
                              "other ranks')")
    with SavedShards(files) as saved:
        meta = saved.meta
        # read one fragment at a time as the optimizer takes them, each master straight into
        # its place (all of them read first would add a copy of the rank's weights to its
        # peak; each read into a temporary, a copy of its largest fragment: the output
        # embedding's 0.78 GiB at rembert's tp 2)
        states = ({kind: saved.read(kind, specs[id(f.param)], f.param_start,
                                    f.param_start + f.numel, tp, tp_rank,
                                    out=f.master if kind == "master" else None)
                   for kind in saved.kinds}
                  for f in optimizer.all_fragments())
        optimizer.load_fragment_states(states, int(meta["inner_step"]), int(meta["steps"]),
                                       int(meta["skipped_steps"]))


class SavedShards:
    """The saved fragments of a step folder's shard files (`files_of`), open:
    (kind, name, writer's TP rank) -> [(lo, hi, handle, key)]. `read` gives a rank's
    fragment at any TP size, `full` a whole tensor."""

    def __init__(self, files: list[Path]):
        self.files, self._stack = files, []
        self._path: dict[int, Path] = {}  # id(open handle) -> its file
        self.ranges: dict[tuple[str, str, int], list[tuple[int, int, object, str]]] = {}
        self.kinds: set[str] = set()
        self.meta: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.layout: tuple[int, int, int] = (1, 1, 1)  # the writer's (tp, pp, dp)

    def __enter__(self) -> SavedShards:
        for path in self.files:
            ctx = safe_open_checked(path)
            handle = ctx.__enter__()
            self._stack.append(ctx)
            self._path[id(handle)] = path
            meta = handle.metadata() or {}
            if meta.get("format") != FORMAT:
                raise CheckpointError(f"{path}: not an optimizer shard of {FORMAT} "
                                      f"(format {meta.get('format')!r})")
            agreed = {k: meta.get(k) for k in _AGREED}
            if self.meta and agreed != self.meta:
                raise CheckpointError(f"{path}: its step counts or layout {agreed} differ "
                                      f"from {self.files[0].name}'s {self.meta}")
            self.meta = agreed
            try:
                shapes = json.loads(meta["shapes"])
                layout = json.loads(meta["layout"])
                self.layout = (int(layout["tp"]), int(layout["pp"]), int(layout["dp"]))
            except (KeyError, ValueError, TypeError) as err:
                raise CheckpointError(f"{path}: unreadable layout or shapes ({err})") from err
            self.shapes.update({n: tuple(s) for n, s in shapes.items()})
            writer_tp_rank = int(_FILE.fullmatch(path.name)[1])
            for key in handle.keys():
                m = _KEY.fullmatch(key)
                if m is None:
                    raise CheckpointError(f"{path}: unexpected tensor {key!r}")
                kind, name, lo, hi = m[1], m[2], int(m[3]), int(m[4])
                self.kinds.add(kind)
                self.ranges.setdefault((kind, name, writer_tp_rank), []).append(
                    (lo, hi, handle, key))
        if len(self.files) != math.prod(self.layout):
            tp, pp, dp = self.layout
            raise CheckpointError(f"{self.files[0].parent}: {len(self.files)} optimizer shard "
                                  f"files, written by tp {tp} x pp {pp} x dp {dp} ranks: the "
                                  "checkpoint is incomplete")
        return self

    def __exit__(self, *exc) -> None:
        for ctx in reversed(self._stack):
            ctx.__exit__(None, None, None)

    def read(self, kind: str, spec: ParamSpec, lo: int, hi: int, tp: int,
             tp_rank: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [lo, hi) of TP rank `tp_rank`'s flattened shard (at TP size `tp`) of
        `spec`'s parameter, of `kind`; into `out` (fp32, 1-d) when given."""
        saved_tp = self.layout[0]
        if spec.split_dim is None or saved_tp == tp:
            return self._range(kind, spec.name, 0 if spec.split_dim is None else tp_rank,
                               lo, hi, out)
        part = shard(self.full(kind, spec), spec, tp, tp_rank).reshape(-1)[lo:hi]
        return part if out is None else out.copy_(part)

    def stored(self, kind: str) -> dict[tuple[str, int], StoredTensor]:
        """What the files hold of `kind` per (parameter name, writer's TP rank), read from the
        headers only: the total size of its fragments (1-d) and, in the file of the first
        fragment not in float32, its dtype (else float32)."""
        found = {}
        for (k, name, tp_rank), ranges in self.ranges.items():
            if k != kind:
                continue
            pieces = [(self._path[id(handle)], _dtype_name(handle, key))
                      for _, _, handle, key in ranges]
            path, dtype = next((p for p in pieces if p[1] != "float32"), pieces[0])
            found[(name, tp_rank)] = StoredTensor(path, name,
                                                  (sum(hi - lo for lo, hi, _, _ in ranges),),
                                                  dtype)
        return found

    def full(self, kind: str, spec: ParamSpec) -> torch.Tensor:
        """The whole tensor of `kind` of `spec`'s parameter (`spec.shape`: TP shards merged,
        vocabulary padding stripped)."""
        if spec.name not in self.shapes:
            raise CheckpointError(f"{self.files[0].parent}: no saved shard of {spec.name}")
        shape = self.shapes[spec.name]
        saved_tp = self.layout[0] if spec.split_dim is not None else 1
        padded = list(shape)
        if spec.split_dim is not None:
            padded[spec.split_dim] *= saved_tp
        n = math.prod(shape)
        if spec.split_dim == 0:  # row shards lie one after the other: read each into place
            full = torch.empty(n * saved_tp, dtype=torch.float32)
            for t in range(saved_tp):
                self._range(kind, spec.name, t, 0, n, full[t * n:(t + 1) * n])
            return full.view(padded)[: spec.shape[0]]  # vocabulary padding stripped
        shards = [self._range(kind, spec.name, t, 0, n).view(shape) for t in range(saved_tp)]
        return merge_shards(shards, ParamSpec(spec.name, spec.split_dim, tuple(padded),
                                              spec.shape, spec.layer))

    def _range(self, kind: str, name: str, writer_tp_rank: int, lo: int, hi: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(hi - lo, dtype=torch.float32)
        covered = 0
        for start, end, handle, key in self.ranges.get((kind, name, writer_tp_rank), []):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                out[a - lo:b - lo] = handle.get_slice(key)[a - start:b - start]
                covered += b - a
        if covered != hi - lo:
            raise CheckpointError(f"{self.files[0].parent}: {kind} of {name} (TP rank "
                                  f"{writer_tp_rank}), elements {lo}:{hi}: only {covered} of "
                                  f"{hi - lo} are in the saved shards")
        return out
