"""The DeepSpeed config: what a user's JSON (parallel.ds_config) may set, and the dict the engine
gets.

One source of truth for every number: batch sizes, precision, the optimizer, its schedule and
clipping live in our config (OWNED names the key of ours for each DeepSpeed key) and are written
into the dict here. Every run trains on our gradient path (training/data_parallel.py), so
DeepSpeed's ZeRO, its bf16 and fp16 optimizers, its gradient reduction and their knobs do
nothing; a JSON that sets one is refused with one line naming the key and the setting of ours
that does that job (REFUSED), and so is a key this trainer does not know to take effect. What a
JSON may set (APPLIED): fp16's loss-scale keys, which our scaler applies with DeepSpeed's
meaning (training/loss_scale.py), and DeepSpeed's own services around its engine.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rembert.config import ConfigError
from megatron_rembert.parallel.layout import Layout
from megatron_rembert.run_config.schema import Config
from megatron_rembert.training.loss_scale import FP16_KEYS, LossScaler

# DeepSpeed key -> the key of ours that sets it.
OWNED = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size and train.micro_batch_size",
    "optimizer": "optim.* (name, lr, beta1, beta2, eps, weight_decay)",
    "scheduler": "optim.* (warmup_steps, decay, decay_start_step, min_lr)",
    "gradient_clipping": "optim.clip_grad",
    "bf16.enabled": "train.precision",
    "fp16.enabled": "train.precision",
    "zero_optimization.stage": "parallel.zero_stage",
    "steps_per_print": "train.log_interval",
}
# DeepSpeed key (a section, or one key of it) -> what does its job here.
REFUSED = {
    "zero_optimization": "every run shards the optimizer state over DP as ZeRO-1 with our "
                         "gradient buffers (parallel.grad_bucket_elements, "
                         "parallel.overlap_weight_gather)",
    "zero_optimization.reduce_bucket_size": "parallel.grad_bucket_elements (the buckets of the "
                                            "gradients' reduce-scatter)",
    "zero_optimization.allgather_bucket_size": "parallel.grad_bucket_elements (the weights' "
                                               "all-gather uses the gradients' buckets)",
    "zero_optimization.overlap_comm": "parallel.overlap_weight_gather (the gradients' "
                                      "reduce-scatter always overlaps the last backward)",
    "zero_optimization.contiguous_gradients": "nothing: the gradients always live in "
                                              "contiguous fp32 buffers",
    "zero_optimization.reduce_scatter": "nothing: the gradients are always reduce-scattered",
    "data_types": "nothing: gradients accumulate into fp32 main gradients in every precision",
    "communication_data_type": "parallel.grad_reduce_dtype",
    "prescale_gradients": "nothing: the loss is normalised by the global batch's masked tokens",
    "gradient_predivide_factor": "nothing: the loss is normalised by the global batch's masked "
                                 "tokens",
    "bf16": "train.precision",
    "amp": "train.precision",
    "zero_allow_untested_optimizer": "nothing: DeepSpeed's ZeRO is not used",
    "zero_force_ds_cpu_optimizer": "nothing: DeepSpeed's ZeRO is not used",
    "activation_checkpointing": "parallel.activation_checkpointing",
    "pipeline": "parallel.pp (the run plan splits the stages)",
    "sparse_gradients": "nothing: the embedding's gradient is added into its fp32 buffer row by "
                        "row",
}
# Sections that take effect: fp16's loss scale (ours), DeepSpeed's services around its engine.
APPLIED = {
    "fp16": "fp16's loss scale (with train.precision=fp16): " + ", ".join(sorted(FP16_KEYS)),
    "wall_clock_breakdown": "DeepSpeed's timers of its engine's phases",
    "flops_profiler": "DeepSpeed's FLOPs profiler",
    "comms_logger": "DeepSpeed's log of its own collectives",
    "tensorboard": "DeepSpeed's monitor",
    "wandb": "DeepSpeed's monitor",
    "csv_monitor": "DeepSpeed's monitor",
}


def _refusal(key: str, value) -> str | None:
    """Why the JSON's top-level `key` (set to `value`) is refused, or None."""
    if key in OWNED:
        return f"sets {key}, which our config owns: remove it and set {OWNED[key]} instead"
    section = value if isinstance(value, dict) else {}
    for sub in section:
        dotted = f"{key}.{sub}"
        if dotted in OWNED:
            return (f"sets {dotted}, which our config owns: remove it and set {OWNED[dotted]} "
                    "instead")
        if dotted in REFUSED:
            return (f"sets {dotted}, which does nothing on this trainer's gradient path: remove "
                    f"it; what does its job: {REFUSED[dotted]}")
    if key in REFUSED:
        return (f"sets {key}, which does nothing on this trainer's gradient path: remove it; "
                f"what does its job: {REFUSED[key]}")
    if key not in APPLIED:
        return (f"sets {key}, which this trainer does not know to take effect; the keys it "
                f"takes: {', '.join(sorted(APPLIED))}")
    return None


def load_ds_config(config: Config) -> dict:
    """The user's DeepSpeed JSON (parallel.ds_config; {} without one), refused with one
    ConfigError naming the file and key if it is missing, not a JSON object, or sets a key
    that our config owns, that does nothing here, or that is unknown; an `fp16` section
    outside fp16 does nothing either."""
    if not config.parallel.ds_config:
        return {}
    path = Path(config.parallel.ds_config)
    where = f"parallel.ds_config={path}"
    if not path.is_file():
        raise ConfigError(f"{where}: no such file")
    try:
        ds = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{where}: not valid JSON ({err})") from err
    if not isinstance(ds, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(ds).__name__}")
    for key, value in ds.items():
        reason = _refusal(key, value)
        if reason:
            raise ConfigError(f"{where} {reason}")
    if "fp16" in ds:
        if config.train.precision != "fp16":
            raise ConfigError(f"{where} sets fp16, which does nothing with train.precision="
                              f"{config.train.precision}: remove it, or set "
                              "train.precision=fp16")
        LossScaler.from_ds_config(  # its keys and values checked here, before anything runs
            {k: v for k, v in ds["fp16"].items() if k != "enabled"}, where)
    return ds


def deepspeed_config(config: Config, layout: Layout, user: dict) -> dict:
    """The dict `deepspeed.initialize` gets: the user's services (`user`, from
    `load_ds_config`) and every number from our Config and the layout, with everything that
    would touch the gradients or the weights' dtype off (our optimizer does all of it; the
    fp16 section's keys are our loss scaler's, training/data_parallel.py)."""
    ds = {k: v for k, v in user.items() if k != "fp16"}
    ds.update(train_batch_size=layout.global_batch_size,
              train_micro_batch_size_per_gpu=layout.micro_batch_size,
              gradient_accumulation_steps=layout.gas,
              steps_per_print=10**9,  # our own logging replaces DeepSpeed's
              gradient_clipping=0.0, zero_optimization={"stage": 0},
              bf16={"enabled": False}, fp16={"enabled": False})
    return ds
