"""The same model, seed and global batch give the same losses in every parallel layout."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.helpers import SEQ, micro_batches

STEPS = 5
GLOBAL_BATCH, MICRO = 8, 2


def _overrides(tp: int, pp: int, zero: int, recompute: bool = False) -> list[str]:
    return [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.zero_stage={zero}",
            f"parallel.activation_checkpointing={str(recompute).lower()}",
            f"train.global_batch_size={GLOBAL_BATCH}", f"train.micro_batch_size={MICRO}",
            "train.precision=fp32", f"train.steps={STEPS}", "optim.warmup_steps=2",
            "optim.lr=3e-3", "optim.clip_grad=0.5", f"data.seq_length={SEQ}"]


def _train_worker(rank, world_size, overrides):
    import deepspeed

    from megatron_rembert.parallel import state
    from megatron_rembert.training.config import build_config, validate_config
    from megatron_rembert.training.engine import Trainer

    deepspeed.init_distributed(dist_backend="gloo")
    config = build_config({"model": {"preset": "tiny"}}, overrides)
    dp = validate_config(config, world_size)
    s = state.initialize_model_parallel(config.parallel.tp, config.parallel.pp)
    trainer = Trainer(config, dp, torch.device("cpu"))
    out = []
    for step in range(STEPS):
        batches = micro_batches(step, GLOBAL_BATCH, MICRO, s.dp_rank, dp,
                                config.model.vocab_size)
        stats = trainer.train_step(batches)
        out.append((stats.loss, stats.grad_norm, stats.masked_tokens))
    # Validation on the trained model: two global batches not seen in training.
    evaluation = trainer.eval_step(micro_batches(STEPS + 1, GLOBAL_BATCH, MICRO, s.dp_rank, dp,
                                                 config.model.vocab_size))
    return out, evaluation


_REFERENCE = {}


def reference():
    if not _REFERENCE:
        _REFERENCE["losses"] = run_distributed(_train_worker, 1, _overrides(1, 1, 1))[0]
    return _REFERENCE["losses"]


@pytest.mark.parametrize("tp, pp, dp, zero, recompute", [
    (1, 2, 1, 1, True),  # DeepSpeed's pipeline activation checkpointing
    (2, 1, 2, 2, True),  # ours (torch.utils.checkpoint per layer), ZeRO-2
    (2, 2, 2, 1, False),
    (3, 2, 1, 1, False),
])
def test_layout_matches_single_process(tp, pp, dp, zero, recompute):
    expected, expected_eval = reference()
    results = run_distributed(_train_worker, tp * pp * dp, _overrides(tp, pp, zero, recompute),
                              timeout=400)
    losses, evaluation = results[0]
    assert evaluation[0] == pytest.approx(expected_eval[0], rel=1e-4)
    assert evaluation[1:] == expected_eval[1:]  # accuracy and masked-token count
    assert len(losses) == STEPS
    for (loss, norm, tokens), (ref_loss, ref_norm, ref_tokens) in zip(losses, expected,
                                                                      strict=True):
        assert tokens == ref_tokens
        assert loss == pytest.approx(ref_loss, rel=1e-4)
        assert norm == pytest.approx(ref_norm, rel=1e-4)
    for other, _ in results[1:]:  # every rank reports the same global loss
        assert [o[0] for o in other] == pytest.approx([e[0] for e in losses], rel=1e-6)
