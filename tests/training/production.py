"""The production path against an independent reference.

`run_train` trains through `train.py`'s own loop (`training.loop.train`: the real data loader,
the DeepSpeed engine, checkpoints) on a dataset made by data_tools, and
reports per step the logged loss and gradient norm, and per parameter (by global name, whole
tensors) how far training moved its fp32 master weight and the norm of Adam's first moment.

`reference_run` trains the same model on the same global batches in plain torch: one process,
fp32, the global batch in one piece, torch's AdamW and `clip_grad_norm_`; no DeepSpeed, no
accumulation, no layout. A parameter that stays frozen moves 0; one whose gradient is counted
twice has twice the first moment (Adam's update alone hardly shows it: it is scale-free).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

VOCAB, SEQ = 1000, 32  # the tiny_dataset fixture
GLOBAL_BATCH, MICRO = 8, 2


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    moved: dict[str, float] = field(default_factory=dict)  # ||w_T - w_0||
    momentum: dict[str, float] = field(default_factory=dict)  # ||Adam's exp_avg||
    valid: dict[str, dict] = field(default_factory=dict)  # the last validation, by language


def data_overrides(data: Path, tokenizer: Path, out: Path, steps: int) -> dict:
    """Data, batch and bookkeeping settings of a short test run (not precision, ds_config or
    layout: those stay the config's own)."""
    return {"data.path": data, "data.tokenizer": tokenizer, "data.seq_length": SEQ,
            "data.num_workers": 0, "train.steps": steps, "train.global_batch_size": GLOBAL_BATCH,
            "train.micro_batch_size": MICRO, "train.log_interval": 1, "train.save_interval": 0,
            "train.eval_interval": steps, "train.eval_batches": 1, "optim.warmup_steps": 1,
            "train.save_dir": out / "ckpt", "train.log_dir": out / "logs",
            "parallel.timeout_minutes": 2}


def as_sets(values: dict) -> list[str]:
    return [f"{k}={v}" for k, v in values.items()]


# -- the production path, in spawned gloo ranks -----------------------------------------------
def _masters_and_momentum(trainer, with_momentum: bool = True) -> tuple[dict, dict]:
    """Full fp32 master weight and (after a step) Adam's exp_avg of each of this rank's
    parameters (all-gathered over DP by our optimizer: a collective; still a TP shard)."""
    from megatron_rembert.training.full_tensors import local_parameters

    masters, momentum = {}, {}
    opt = trainer.optimizer
    full = opt.full_tensors()
    order = [p for group in opt.model_groups for p in group]
    index = {id(p): i for i, p in enumerate(order)}
    for name, param in local_parameters(trainer.engine.module):
        i = index[id(param)]
        masters[name] = full["weights"][i].float()
        if with_momentum:
            exp_avg = full["state"].get("exp_avg")
            momentum[name] = (exp_avg[i] if exp_avg else torch.zeros_like(masters[name]))
    return masters, momentum


def _tp_norms(tensors: dict, trainer) -> dict[str, float]:
    """||tensor|| of whole parameters: squares of TP shards summed over the TP group."""
    import torch.distributed as dist

    from megatron_rembert.parallel import state
    from megatron_rembert.parallel.layers import is_tp_sharded
    from megatron_rembert.training.full_tensors import local_parameters

    sharded = {n: is_tp_sharded(p) for n, p in local_parameters(trainer.engine.module)}
    out = {}
    for name, t in tensors.items():
        square = t.double().square().sum()
        if sharded[name] and state.tp_size() > 1:
            dist.all_reduce(square, group=state.tp_group())
        out[name] = square.sqrt().item()
    return out


def run_train(rank, world_size, runs: list[tuple[str, list[str]]]) -> list[Run]:
    """`loop.train` for each (config file, overrides), in turn, in this group."""
    from megatron_rembert.run_config.load import load_config
    from megatron_rembert.training import engine, loop

    built = []
    real_init = engine.Trainer.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.initial_masters = _masters_and_momentum(self, with_momentum=False)[0]
        built.append(self)

    engine.Trainer.__init__ = init
    results = []
    for path, sets in runs:
        config = load_config(path, sets)
        loop.train(config)
        trainer = built[-1]
        masters, momentum = _masters_and_momentum(trainer)
        run = Run(moved=_tp_norms({n: masters[n] - trainer.initial_masters[n]
                                   for n in masters}, trainer),
                  momentum=_tp_norms(momentum, trainer))
        if rank == 0:
            rows = [json.loads(line) for line in
                    (Path(config.train.log_dir) / "metrics.jsonl").read_text().splitlines()]
            train_rows = [r for r in rows if r["split"] == "train"]
            run.losses = [r["loss"] for r in train_rows]
            run.grad_norms = [r["grad_norm"] for r in train_rows]
            run.valid = [r for r in rows if r["split"] == "valid"][-1]["languages"]
        results.append(run)
    return results


def merge_ranks(per_rank: list[Run]) -> Run:
    """Rank 0's metrics and every rank's parameters (pipeline stages own different ones)."""
    merged = Run(losses=per_rank[0].losses, grad_norms=per_rank[0].grad_norms,
                 valid=per_rank[0].valid)
    for run in per_rank:
        merged.moved.update(run.moved)
        merged.momentum.update(run.momentum)
    return merged


# -- the independent reference, in this process ------------------------------------------------
def reference_run(path: str, sets: list[str]) -> Run:
    """Plain torch, fp32, one process, each global batch in one piece."""
    from megatron_rembert.data.loader import build_pretraining_loader
    from megatron_rembert.data.schedule import DataPlan
    from megatron_rembert.model.rembert import RemBertForPreTraining
    from megatron_rembert.parallel.layout import Layout
    from megatron_rembert.run_config.load import load_config
    from megatron_rembert.training.optim import LRSchedule, build_optimizer, build_scheduler

    config = load_config(path, sets + ["train.precision=fp32", "parallel.tp=1",
                                       "parallel.pp=1"])
    data, train = config.data, config.train
    model = RemBertForPreTraining(config.model)
    model.init_weights(train.seed)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, LRSchedule.of(config))
    # The whole global batch as one micro-batch.
    layout = Layout(micro_batch_size=train.global_batch_size)
    plan = DataPlan.resolve(data, train.steps, config.eval.mask_prob)
    loader = build_pretraining_loader(data, layout, plan, seed=train.seed, num_workers=0)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    run = Run()
    for _ in range(train.steps):
        out = model(**next(loader))
        loss = out.loss_sum / out.num_tokens.clamp(min=1.0)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.clip_grad)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        run.losses.append(loss.item())
        run.grad_norms.append(norm.item())
    for name, p in model.named_parameters():
        run.moved[name] = (p.detach() - initial[name]).double().norm().item()
        run.momentum[name] = optimizer.state[p]["exp_avg"].double().norm().item()
    return run
