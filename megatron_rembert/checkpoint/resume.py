"""Resuming a run: what the checkpoint `latest` names means for this run, decided before the
model is built, without the engine (loading into it is training/checkpoint.py).

- `check_resume`, the one call the training loop makes: the checkpoint is this run's (the same
  model, execution fields aside; the same tokenizer and dataset), how it loads at this run's
  layout (`check_layout`) and what changes, one notice each (`resume_notices`, and another
  pipeline stage split: `other_stage_split`);
- `data_position`: where the data continues after the checkpoint's `consumed_samples`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from megatron_rembert.checkpoint import CheckpointError
from megatron_rembert.checkpoint.reader import check_format
from megatron_rembert.checkpoint.step_folder import StepFolder
from megatron_rembert.config import EXECUTION_FIELDS
from megatron_rembert.model.cost import layer_parameters
from megatron_rembert.parallel.layout import Layout
from megatron_rembert.run_config.schema import Config

# The LR multiplier of a config at a step (training/optim.py: lr_lambda). checkpoint/ sits
# below training/, so the notices take it as an argument.
LRSchedule = Callable[[Config], Callable[[int], float]]

# What shapes the LR schedule (training/optim.py: lr_lambda), as (section, key).
SCHEDULE_KEYS = (("train", "steps"), ("optim", "lr"), ("optim", "warmup_steps"),
                 ("optim", "decay"), ("optim", "decay_start_step"), ("optim", "min_lr"))


def check_resume(step: StepFolder, config: Config, meta_now: dict, layout: Layout,
                 lr_schedule: LRSchedule) -> tuple[str, list[str]]:
    """Everything a resume of `step` checks before the model is built. `meta_now`: the
    meta.json this run writes (its model, tokenizer and dataset hashes, stage boundaries).
    Returns how the checkpoint loads ('same' or 'full': `check_layout`) and what changes, one
    line each, for rank 0 to print."""
    check_format(step)
    check_same_run(step, config, meta_now)
    boundaries = meta_now["stage_boundaries"]
    saved_stages = other_stage_split(step.meta, config, layout, boundaries)
    how = check_layout(step, layout, saved_stages)
    notices = [] if saved_stages is None else [
        f"{step.path}: saved with pipeline stages {saved_stages}, this run splits them as "
        f"{boundaries}: loading full tensors"]
    return how, notices + resume_notices(step, config, lr_schedule)


def check_same_run(step: StepFolder, config: Config, meta_now: dict) -> None:
    """Refuse a checkpoint of another model (execution fields aside), tokenizer or dataset."""
    old = step.meta["config"]["model"]
    new = meta_now["config"]["model"]
    changed = sorted(k for k in new if k not in (*EXECUTION_FIELDS, "preset")
                     and old.get(k) != new[k])
    if changed:
        raise CheckpointError(
            f"{step.path}: the checkpoint's model differs from the config in {changed}; resume "
            "with the same model or use a different train.save_dir")
    for key, flag in (("tokenizer_sha256", "data.tokenizer"), ("dataset_sha256", "data.path")):
        saved, now = step.meta.get(key), meta_now.get(key)
        if saved and now and saved != now:
            raise CheckpointError(
                f"{step.path} was trained with {key} {saved[:12]}..., {flag}="
                f"{getattr(config.data, flag.split('.')[1])} has {now[:12]}...; resume with the "
                f"checkpoint's {flag} or use a different train.save_dir")


def parameter_balanced_boundaries(config: Config, pp: int) -> list[int]:
    """The pipeline split of earlier versions (DeepSpeed's `partition_balanced` over parameter
    counts), for reading checkpoints that did not record their boundaries."""
    from deepspeed.runtime.utils import partition_balanced

    return list(partition_balanced(weights=layer_parameters(config.model), num_parts=pp))


def other_stage_split(meta: dict, config: Config, layout: Layout,
                      boundaries: list[int] | None) -> list[int] | None:
    """The pipeline split a checkpoint saved at this run's layout was saved with, when it
    differs from `boundaries` (this run's); None when it is the same, when pp = 1, or when
    the checkpoint's layout is another (it then loads by `check_layout`'s other rules).
    Checkpoints made before stages were balanced by FLOPs record none: theirs is DeepSpeed's
    parameter balance."""
    if layout.pp == 1 or meta["layout"] != layout.sizes():
        return None
    saved = meta.get("stage_boundaries") or parameter_balanced_boundaries(config, layout.pp)
    return None if list(saved) == list(boundaries) else list(saved)


def check_layout(step: StepFolder, layout: Layout, saved_stages: list[int] | None = None
                 ) -> str:
    """How a checkpoint loads at this run's layout, decided before the model is built:
    'same' (everything, RNG states included) or 'full' (each rank reads its part of every
    tensor, fp32 masters and optimizer state included, whatever the saved layout, precision
    and path; RNG states start fresh).

    `saved_stages`: the checkpoint's pipeline split where it differs from this run's
    (`other_stage_split`); the same layout then also loads 'full'."""
    if step.meta["layout"] == layout.sizes():
        return "same" if saved_stages is None else "full"
    return "full"


def data_position(consumed_samples: int, global_batch_size: int) -> int:
    """Where the data resumes: the first multiple of the global batch at or after
    `consumed_samples` (the stream is indexed by samples; see data/sampler.py)."""
    return -(-consumed_samples // global_batch_size) * global_batch_size


def resume_notices(step: StepFolder, config: Config, lr_schedule: LRSchedule) -> list[str]:
    """What changes when `config` resumes the checkpoint with another global batch size or
    another LR schedule: one line each. A weights-only checkpoint (a conversion) starts from
    step 0 with a fresh schedule: nothing to say."""
    meta, folder = step.meta, step.path
    if meta.get("weights_only"):
        return []
    notices, saved = [], meta["config"]
    at, consumed = int(meta["step"]), int(meta["consumed_samples"])
    old_batch, batch = saved["train"]["global_batch_size"], config.train.global_batch_size
    if old_batch != batch:
        position = data_position(consumed, batch)
        where = (f"the data continues at sample {consumed}" if position == consumed else
                 f"{consumed} is not a multiple of {batch}: the data continues at sample "
                 f"{position}, skipping {position - consumed} samples")
        notices.append(
            f"{folder}: train.global_batch_size {old_batch} -> {batch}; {consumed} samples "
            f"consumed in {at} steps, {where}. Steps continue from {at} with {batch} "
            f"samples each; the data schedules (data.phase_starts, data.language_start) count "
            f"a step as {batch} samples from the start")
    changed = [(section, key, saved.get(section, {}).get(key), getattr(getattr(config, section),
                                                                        key))
               for section, key in SCHEDULE_KEYS]
    changed = [c for c in changed if c[2] is not None and c[2] != c[3]]
    if changed:
        before = copy.deepcopy(config)
        for section, key, value, _ in changed:
            setattr(getattr(before, section), key, value)
        base = before.optim.lr  # the restored scheduler keeps the checkpoint's base rate
        # The optimizer's restored LR is the checkpoint's for one more step; the scheduler's
        # next step applies the new shape.
        lr_then = base * lr_schedule(before)(at)
        lr_next = base * lr_schedule(config)(at + 1)
        what = ", ".join(f"{s}.{k} {a} -> {b}" for s, k, a, b in changed)
        notices.append(
            f"{folder}: the LR schedule changes shape ({what}); step {at + 1} trains at the "
            f"checkpoint's LR {lr_then:.4g}, step {at + 2} at {lr_next:.4g} and the "
            "following steps on the new schedule"
            + (f"; optim.lr is not applied on resume: the restored scheduler keeps the "
               f"checkpoint's base rate {base:g}" if before.optim.lr != config.optim.lr else ""))
    return notices
