"""What `--dry-run` assumes of the machine for its communication estimate
(training/communication.py): link bandwidths within and across nodes, GPUs per node, and the
fraction of the GPU's peak the matmuls reach. Torch-free: train.py's --help shows the defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rembert.config import ConfigError

# train.py's flag for each field, its type and meaning (the default is the field's).
FLAGS = {
    "intra_node_gbps": ("--intra-node-gbps", float,
                        "link bandwidth between the GPUs of one node, Gb/s per GPU and direction"),
    "inter_node_gbps": ("--inter-node-gbps", float,
                        "network bandwidth between nodes, Gb/s per GPU and direction"),
    "gpus_per_node": ("--gpus-per-node", int, "ranks per node (rank // this is its node)"),
    "mfu": ("--assume-mfu", float,
            "fraction of the GPU's bf16 peak the matmuls reach while computing, in (0, 1]"),
    "gpu": ("--gpu", str, "the GPU whose bf16 peak FLOP/s the compute time takes (a name in "
            "training/metrics.py's table)"),
}


@dataclass(frozen=True)
class LinkAssumptions:
    """What `--dry-run` assumes of the machine (train.py's flags; defaults: an H100 node of 8
    GPUs on NVLink 4, 450 GB/s per direction, and one 400 Gb/s NIC per GPU)."""

    intra_node_gbps: float = 3600.0  # gigabits per second per GPU, each direction
    inter_node_gbps: float = 400.0
    gpus_per_node: int = 8
    # The fraction of peak the rank's matmuls reach while computing, applied to the FLOPs the
    # stage split counts (recomputation and the head's padded slots included): the rembert
    # model step alone, 16 x 512 in bf16 on one H200, reached 36.7-37.8% in model FLOPs (README)
    mfu: float = 0.4
    gpu: str = "H100"

    def __post_init__(self):
        from megatron_rembert.training.metrics import PEAK_BF16_FLOPS  # torch: only when used

        for field in ("intra_node_gbps", "inter_node_gbps"):
            value = getattr(self, field)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{FLAGS[field][0]} {value:g}: must be a bandwidth > 0 (Gb/s)")
        if self.gpus_per_node < 1:
            raise ConfigError(f"{FLAGS['gpus_per_node'][0]} {self.gpus_per_node}: must be >= 1")
        if not (math.isfinite(self.mfu) and 0 < self.mfu <= 1):
            raise ConfigError(f"{FLAGS['mfu'][0]} {self.mfu:g}: must be in (0, 1]")
        if self.gpu not in PEAK_BF16_FLOPS:
            raise ConfigError(f"{FLAGS['gpu'][0]} {self.gpu}: one of "
                              f"{', '.join(sorted(PEAK_BF16_FLOPS))}")

    @property
    def peak_flops(self) -> float:
        from megatron_rembert.training.metrics import PEAK_BF16_FLOPS

        return PEAK_BF16_FLOPS[self.gpu]

    def inter_node(self, ranks: tuple[int, ...]) -> bool:
        return len({r // self.gpus_per_node for r in ranks}) > 1

    def bytes_per_second(self, ranks: tuple[int, ...]) -> float:
        gbps = self.inter_node_gbps if self.inter_node(ranks) else self.intra_node_gbps
        return gbps * 1e9 / 8
