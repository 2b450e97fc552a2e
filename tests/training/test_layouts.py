"""The same model, seed and global batch give the same losses in every parallel layout."""

import pytest

from tests.distributed import run_distributed
from tests.training.helpers import STEPS, layout_overrides, train_worker

pytestmark = pytest.mark.multiprocess  # every test here starts processes


# Without recomputation, tp2 x pp2 x dp2 and the shipped JSONs run through train.py's loop in
# test_production_path.py; these are the layouts it does not cover.
@pytest.mark.parametrize("tp, pp, dp, recompute", [
    (1, 2, 1, True),  # DeepSpeed's pipeline activation checkpointing
    (2, 1, 2, True),  # ours (torch.utils.checkpoint per layer)
    (3, 2, 1, False),  # an odd TP size: 2 heads per rank, vocabulary padded to 3 x 384
])
def test_layout_matches_single_process(tp, pp, dp, recompute, layout_reference):
    expected, expected_eval, expected_moved = layout_reference
    results = run_distributed(train_worker, tp * pp * dp,
                              layout_overrides(tp, pp, recompute), timeout=400)
    losses, evaluation, _ = results[0]
    assert evaluation[0] == pytest.approx(expected_eval[0], rel=1e-4)
    assert evaluation[1:] == expected_eval[1:]  # accuracy and masked-token count
    assert len(losses) == STEPS
    for (loss, norm, tokens, *_), (ref_loss, ref_norm, ref_tokens, *_) in zip(
            losses, expected, strict=True):
        assert tokens == ref_tokens
        assert loss == pytest.approx(ref_loss, rel=1e-4)
        assert norm == pytest.approx(ref_norm, rel=1e-4)
    for other, *_ in results[1:]:  # every rank reports the same global loss
        assert [o[0] for o in other] == pytest.approx([e[0] for e in losses], rel=1e-6)
    # How far each parameter moved: this catches what the loss hardly feels, such as a
    # clipping norm that misses some parameters (DeepSpeed's pipeline engine without ZeRO).
    moved = {}
    for *_, rank_moved in results:
        moved.update(rank_moved)
    assert moved.keys() == expected_moved.keys()
    for name, distance in expected_moved.items():
        assert moved[name] == pytest.approx(distance, rel=1e-4, abs=1e-7), name
