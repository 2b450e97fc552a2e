"""The parallel layout of a run, built and checked once: sizes, batch split and this rank.

    world = pp x dp x tp                 (tensor-parallel ranks vary fastest)
    global batch = micro batch x gas x dp (gas: gradient-accumulation micro-batches per step)

Global rank = (pp_rank * dp + dp_rank) * tp + tp_rank: the order of DeepSpeed's
`PipeModelDataParallelTopology` (axes pipe, data, model; model fastest), so our process
groups, the pipeline engine and ZeRO agree on who is who.

`Layout.build` is the one place that derives dp and gas and checks that they divide; everyone
else (process groups, engine, DeepSpeed config, data loader, dry run, checkpoint metadata)
takes the `Layout`. Plain Python, no torch: the data loader imports it too.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rembert.config import ConfigError


def layout_rank(pp_rank: int, dp_rank: int, tp_rank: int, dp: int, tp: int) -> int:
    return (pp_rank * dp + dp_rank) * tp + tp_rank


def layout_coords(rank: int, dp: int, tp: int) -> tuple[int, int, int]:
    """(pp_rank, dp_rank, tp_rank) of a global rank."""
    return rank // (dp * tp), (rank // tp) % dp, rank % tp


@dataclass(frozen=True)
class Layout:
    """Sizes of the three parallel axes, the batch split, and this process's global rank.

    Holds only independent numbers; the world size, the global batch and the per-axis ranks
    are derived. Build it with `Layout.build`, which names the flag at fault."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    gas: int = 1  # micro-batches per optimizer step on each DP rank
    rank: int = 0

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "micro_batch_size", "gas"):
            if getattr(self, name) < 1:
                raise ValueError(f"Layout.{name}={getattr(self, name)}: must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Layout.rank={self.rank} not in [0, {self.world_size})")

    @classmethod
    def build(cls, world_size: int, rank: int = 0, *, tp: int = 1, pp: int = 1,
              micro_batch_size: int = 1, global_batch_size: int | None = None) -> Layout:
        """The layout of `world_size` processes at parallel.tp x parallel.pp, each step taking
        `global_batch_size` samples (default: one micro-batch per DP rank) in micro-batches
        of `micro_batch_size`; raises ConfigError naming the flag that does not fit."""
        if tp < 1 or pp < 1 or world_size % (tp * pp):
            raise ConfigError(
                f"world size {world_size} is not divisible by parallel.tp x parallel.pp = "
                f"{tp} x {pp}; change the number of processes or the layout")
        dp = world_size // (tp * pp)
        if micro_batch_size < 1:
            raise ConfigError(f"train.micro_batch_size={micro_batch_size}: must be >= 1")
        if global_batch_size is None:
            global_batch_size = micro_batch_size * dp
        per_step = micro_batch_size * dp
        if global_batch_size < per_step or global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size={global_batch_size} is not a multiple of "
                f"train.micro_batch_size x DP = {micro_batch_size} x {dp}")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside the world of {world_size} processes")
        return cls(tp=tp, pp=pp, dp=dp, micro_batch_size=micro_batch_size,
                   gas=global_batch_size // per_step, rank=rank)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gas * self.dp

    @property
    def pp_rank(self) -> int:
        return layout_coords(self.rank, self.dp, self.tp)[0]

    @property
    def dp_rank(self) -> int:
        return layout_coords(self.rank, self.dp, self.tp)[1]

    @property
    def tp_rank(self) -> int:
        return layout_coords(self.rank, self.dp, self.tp)[2]

    def sizes(self) -> dict[str, int]:
        """{"tp", "pp", "dp"}: what a checkpoint records and a resume compares."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp}
