"""The Layout: derived once from the flags and the world size, errors naming the flag."""

import pytest

from megatron_rembert.config import ConfigError
from megatron_rembert.parallel.layout import Layout, layout_rank


def test_sizes_batch_split_and_ranks():
    layout = Layout.build(24, 13, tp=2, pp=3, micro_batch_size=4, global_batch_size=64)
    assert (layout.dp, layout.gas, layout.world_size, layout.global_batch_size) == (4, 4, 24, 64)
    # rank 13 = (pp_rank 1 * dp 4 + dp_rank 2) * tp 2 + tp_rank 1
    assert (layout.pp_rank, layout.dp_rank, layout.tp_rank) == (1, 2, 1)
    assert layout_rank(1, 2, 1, dp=4, tp=2) == 13
    assert layout.sizes() == {"tp": 2, "pp": 3, "dp": 4}
    assert Layout.build(4, tp=2).gas == 1  # default: one micro-batch per DP rank and step


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=6, tp=4), r"world size 6 is not divisible by parallel.tp x parallel.pp"),
    (dict(world_size=4, pp=0), r"parallel.tp x parallel.pp = 1 x 0"),
    (dict(world_size=2, micro_batch_size=0), r"train.micro_batch_size=0: must be >= 1"),
    (dict(world_size=2, micro_batch_size=4, global_batch_size=12),
     r"train.global_batch_size=12 is not a multiple of train.micro_batch_size x DP = 4 x 2"),
    (dict(world_size=2, micro_batch_size=4, global_batch_size=0),
     r"train.global_batch_size=0 is not a multiple"),
    (dict(world_size=2, rank=2), r"rank 2 is outside the world of 2 processes"),
])
def test_errors_name_the_flag(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Layout.build(**kwargs)
