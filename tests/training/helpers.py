"""Synthetic MLM samples as a pure function of (seed, global index), and layout runs."""

from __future__ import annotations

import torch

from megatron_rembert.data.batch import unpadded_flag

SEQ, PREDICTIONS = 16, 4


def sample(index: int, vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    length = int(torch.randint(8, SEQ + 1, (1,), generator=g))
    ids = torch.zeros(SEQ, dtype=torch.long)
    ids[:length] = torch.randint(5, vocab_size, (length,), generator=g)
    mask = torch.zeros(SEQ, dtype=torch.long)
    mask[:length] = 1
    n_pred = int(torch.randint(1, PREDICTIONS + 1, (1,), generator=g))
    positions = torch.zeros(PREDICTIONS, dtype=torch.long)
    positions[:n_pred] = torch.randperm(length, generator=g)[:n_pred]
    labels = torch.zeros(PREDICTIONS, dtype=torch.long)
    labels[:n_pred] = ids[positions[:n_pred]]
    weights = torch.zeros(PREDICTIONS)
    weights[:n_pred] = 1.0
    ids[positions[:n_pred]] = 4  # [MASK]
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids),
                masked_positions=positions, masked_labels=labels, masked_weights=weights)


def micro_batches(step: int, global_batch: int, micro: int, dp_rank: int, dp: int,
                  vocab_size: int) -> list[dict[str, torch.Tensor]]:
    """This DP rank's micro-batches of global batch `step` (a contiguous slice of it)."""
    per_rank = global_batch // dp
    start = step * global_batch + dp_rank * per_rank
    samples = [sample(start + i, vocab_size) for i in range(per_rank)]
    batches = [{k: torch.stack([s[k] for s in samples[i:i + micro]]) for k in samples[0]}
               for i in range(0, per_rank, micro)]
    return [{**b, "unpadded": torch.from_numpy(unpadded_flag(b["attention_mask"].numpy()))}
            for b in batches]


def split_micro(batch: dict[str, torch.Tensor], micro: int) -> list[dict[str, torch.Tensor]]:
    """A batch of model inputs cut into micro-batches of `micro` rows, each with the loader's
    `unpadded` flag."""
    out = []
    for i in range(0, len(batch["input_ids"]), micro):
        b = {k: v[i:i + micro] for k, v in batch.items()}
        out.append({**b, "unpadded": torch.from_numpy(unpadded_flag(b["attention_mask"].numpy()))})
    return out


STEPS = 5
GLOBAL_BATCH, MICRO = 8, 2


def layout_overrides(tp: int, pp: int, recompute: bool = False, **extra) -> list[str]:
    """The tiny model trained for STEPS steps on the synthetic samples above."""
    values = {"parallel.tp": tp, "parallel.pp": pp,
              "parallel.activation_checkpointing": str(recompute).lower(),
              "train.global_batch_size": GLOBAL_BATCH, "train.micro_batch_size": MICRO,
              "train.precision": "fp32", "train.steps": STEPS, "optim.warmup_steps": 2,
              "optim.lr": 3e-3, "optim.clip_grad": 0.5, "data.seq_length": SEQ}
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def train_worker(rank, world_size, overrides):
    """Train with the Trainer on synthetic data. Per step: loss, grad norm, masked tokens,
    loss scale, skipped, the learning rate applied, and whether this rank's weights changed;
    then the validation (loss, accuracy, tokens) of the trained model, and how far training
    moved each of this rank's parameters (by global name, whole tensors)."""
    import deepspeed

    from megatron_rembert.parallel import state
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.full_tensors import local_parameters
    from megatron_rembert.training.plan import RunPlan
    from tests.training.production import _masters_and_momentum

    deepspeed.init_distributed(dist_backend="gloo")
    config = build_config({"model": {"preset": "tiny"}}, overrides)
    plan = RunPlan.build(config, world_size, rank)
    layout = plan.layout
    s = state.initialize_model_parallel(layout)
    trainer = Trainer(config, plan, torch.device("cpu"))
    initial = _masters_and_momentum(trainer, with_momentum=False)[0]
    out = []
    for step in range(config.train.steps):
        batches = micro_batches(step, GLOBAL_BATCH, MICRO, s.dp_rank, layout.dp,
                                config.model.vocab_size)
        before = [p.detach().clone() for p in trainer.engine.module.parameters()]
        stats = trainer.train_step(batches)
        trainer.wait_for_weights()  # parallel.overlap_weight_gather leaves them in flight
        changed = any(not torch.equal(b, p) for b, p in
                      zip(before, trainer.engine.module.parameters(), strict=True))
        out.append((stats.loss, stats.grad_norm, stats.masked_tokens, stats.loss_scale,
                    stats.skipped, stats.lr, changed))
    # Validation on the trained model: a global batch not seen in training.
    evaluation = trainer.eval_step(micro_batches(config.train.steps + 1, GLOBAL_BATCH, MICRO,
                                                 s.dp_rank, layout.dp,
                                                 config.model.vocab_size))
    # How far training moved each whole fp32 master weight: ||w_T - w_0||, TP shards summed.
    moved, final = {}, _masters_and_momentum(trainer, with_momentum=False)[0]
    for name, param in local_parameters(trainer.engine.module):
        square = (final[name] - initial[name]).square().sum()
        if getattr(param, "tensor_model_parallel", False):
            torch.distributed.all_reduce(square, group=s.tp_group)
        moved[name] = square.sqrt().item()
    return out, evaluation, moved
