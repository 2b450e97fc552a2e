"""What the benches share: timing, device sync, synthetic MLM batches, JSON figures and the
relative error their correctness checks use. Needs only torch (a bare GPU image has it)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from megatron_rembert.config import ModelConfig


def device_sync(device: torch.device | str) -> Callable[[], None]:
    """What waits for `device` to finish its queued work (nothing to wait for on the CPU)."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def timed(step: Callable[[Any], None], batches: Iterable, sync: Callable[[], None]) -> float:
    """Seconds per step: `step(batch)` for each batch, the first a warm-up, then the median
    of the rest, each between two `sync()`s."""
    times = []
    for i, batch in enumerate(batches):
        sync()
        start = time.perf_counter()
        step(batch)
        sync()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_json(path: str | Path, figures: dict) -> None:
    """A bench's figures, for bench/gpu_table.py (gpu_table.SCHEMA names the keys)."""
    Path(path).write_text(json.dumps(figures, indent=1))


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max|ours - ref| / max|ref|; inf when ours is not finite where ref is."""
    ours, ref = ours.float(), ref.float()
    if not torch.isfinite(ours[torch.isfinite(ref)]).all():
        return float("inf")
    return ((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def make_batch(config: ModelConfig, batch: int, seq: int, seed: int, device,
               predictions: int | None = None) -> dict:
    """Random tokens, `predictions` positions masked (default 15%; fixed width P, all slots
    used), no padding (`unpadded`: attention without a mask). On `device`, but `unpadded`
    stays on the host, as the loader delivers it."""
    g = torch.Generator().manual_seed(seed)
    predictions = predictions or max(1, round(0.15 * seq))
    ids = torch.randint(5, config.vocab_size, (batch, seq), generator=g)
    positions = torch.stack([torch.randperm(seq, generator=g)[:predictions]
                             for _ in range(batch)])
    labels = ids.gather(1, positions)
    ids = ids.scatter(1, positions, 4)  # [MASK]
    out = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
               token_type_ids=torch.zeros_like(ids), masked_positions=positions,
               masked_labels=labels, masked_weights=torch.ones(batch, predictions),
               unpadded=torch.ones(1, dtype=torch.long))
    return {k: v if k == "unpadded" else v.to(device) for k, v in out.items()}


def hf_labels(batch: dict) -> torch.Tensor:
    """transformers' labels for `batch`: -100 except at the masked positions."""
    labels = torch.full_like(batch["input_ids"], -100)
    return labels.scatter(1, batch["masked_positions"], batch["masked_labels"])


# The smallest run of a checkpoint bench (seconds): tests/bench/test_every_bench.py.
CHECKPOINT_TINY_ARGS = ["--hidden", "64", "--layers", "1", "--vocab", "1000", "--reps", "1"]


def checkpoint_parser(description: str):
    """The arguments the checkpoint benches share: the scaled model, repetitions, folder."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=30000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", help="where to write (default: a temporary folder)")
    return parser


def checkpoint_meta(config) -> dict:
    """meta.json's fields a one-process save of `config` records."""
    return {"config": config.to_dict(), "tokenizer_sha256": None,
            "layout": {"tp": 1, "pp": 1, "dp": 1}}


def checkpoint_trainer(hidden: int, layers: int, vocab: int, port: int):
    """One process (gloo) with the trainer of a scaled RemBERT in fp32 under ZeRO-1: what the
    checkpoint benches save. Returns (trainer, config)."""
    import deepspeed

    from megatron_rembert.launch_env import launch_env, publish
    from megatron_rembert.parallel import state
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.plan import RunPlan

    publish(launch_env(default_port=port))
    deepspeed.init_distributed(dist_backend="gloo")
    model = {"preset": "tiny", "vocab_size": vocab, "hidden_size": hidden,
             "num_hidden_layers": layers, "num_attention_heads": 8,
             "intermediate_size": 4 * hidden, "input_embedding_size": 128,
             "output_embedding_size": 256}
    config = build_config({"model": model}, [
        "parallel.zero_stage=1", "train.precision=fp32", "train.global_batch_size=2",
        "train.micro_batch_size=2", "data.seq_length=32"])
    plan = RunPlan.build(config, 1)
    state.initialize_model_parallel(plan.layout)
    return Trainer(config, plan, torch.device("cpu")), config
