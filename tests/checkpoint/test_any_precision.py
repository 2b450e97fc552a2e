"""A checkpoint of the production path resumes in the other precision without a conversion:
the optimizer shards' fp32 masters and moments are the state, whatever the weights' dtype."""

import pytest

from tests.checkpoint.workers import precision_change_worker
from tests.distributed import run_distributed

pytestmark = pytest.mark.multiprocess  # gloo ranks


@pytest.mark.parametrize("saved, resumed, world", [("bf16", "fp32", 2), ("fp32", "bf16", 1)])
def test_a_checkpoint_resumes_in_the_other_precision(tmp_path, saved, resumed, world):
    for out in run_distributed(precision_change_worker, world, str(tmp_path), saved, resumed,
                               timeout=300):
        assert out["names"]
        assert out["dtypes"] == ["torch.float32" if resumed == "fp32" else "torch.bfloat16"]
        # the saving run's masters and moments exactly, and its weights: the masters rounded
        assert out["masters"] and out["moments"] and out["weights"], out
        assert out["lr"]
