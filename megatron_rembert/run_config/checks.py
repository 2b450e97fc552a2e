"""The checks of a loaded Config that need no world size: every value in its range or
choices, the settings that depend on each other, the paths; each problem one ConfigError
naming the key."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rembert.config import ConfigError, check_buildable, check_choice
from megatron_rembert.fs import unwritable_reason
from megatron_rembert.run_config.schema import CHOICES, RANGES, ZERO_STAGE, Config

if TYPE_CHECKING:
    from megatron_rembert.data.schedule import DataPlan


def check_ranges(config: Config) -> None:
    """Every numeric setting finite and in its range (RANGES), every choice one of its values
    (CHOICES), the schedules well formed; naming the key if not."""
    for key, allowed in RANGES.items():
        section, name = key.split(".")
        allowed.check(key, getattr(getattr(config, section), name))
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        check_choice(key, getattr(getattr(config, section), name), allowed)
    if config.data.max_predictions > config.data.seq_length:
        raise ConfigError(f"data.max_predictions={config.data.max_predictions} exceeds "
                          f"data.seq_length={config.data.seq_length}")
    if config.optim.min_lr > config.optim.lr:
        raise ConfigError(f"optim.min_lr={config.optim.min_lr} exceeds "
                          f"optim.lr={config.optim.lr}")
    factor = config.train.divergence_factor
    if 0 < factor <= 1:
        raise ConfigError(f"train.divergence_factor={factor}: 0 (off) or above 1 (a loss "
                          "this many times its recent mean stops the run)")
    check_schedule(config)


def check_schedule(config: Config) -> None:
    """The data schedules and the LR's decay start, each problem one line naming the key.
    Language names are checked against the dataset at start-up (training.inputs.check_inputs),
    P against the largest mask rate where it is derived (data.schedule.DataPlan.resolve)."""
    data, steps = config.data, config.train.steps
    starts = data.phase_starts
    if starts and starts[0] != 0.0:
        raise ConfigError(f"data.phase_starts={starts}: the first phase must start at 0.0")
    for a, b in zip(starts, starts[1:], strict=False):
        if not a < b:
            raise ConfigError(f"data.phase_starts={starts}: phases out of order ({a} then {b}); "
                              "give increasing fractions of train.steps")
    if starts and not starts[-1] <= 1.0:
        raise ConfigError(f"data.phase_starts={starts}: fractions of train.steps, at most 1.0")
    for key, allowed in (("phase_alpha", RANGES["data.alpha"]),
                         ("phase_mask_prob", RANGES["data.mask_prob"])):
        values = getattr(data, key)
        if values and len(values) != len(starts):
            raise ConfigError(f"data.{key} has {len(values)} values, data.phase_starts "
                              f"{len(starts)}: give one per phase")
        for v in values:
            if v not in allowed:
                raise ConfigError(f"data.{key}={values}: {v} is not in {allowed}")
    for lang, f in data.language_start.items():
        if not 0.0 <= f < 1.0:
            raise ConfigError(f"data.language_start.{lang}={f}: a fraction of train.steps in "
                              "[0, 1)")
    if config.optim.decay_start_step and not (
            config.optim.warmup_steps <= config.optim.decay_start_step < steps):
        raise ConfigError(f"optim.decay_start_step={config.optim.decay_start_step}: must be in "
                          f"[optim.warmup_steps={config.optim.warmup_steps}, train.steps={steps})"
                          " (0: decay right after warm-up)")


def check_paths(config: Config) -> None:
    """train.save_dir and train.log_dir: a folder, or one that can be made, and writable."""
    for key in ("train.save_dir", "train.log_dir"):
        text = getattr(config.train, key.split(".")[1])
        if not text:
            raise ConfigError(f"{key} is empty: set it to a folder")
        reason = unwritable_reason(text)
        if reason:
            raise ConfigError(f"{key}={text}: {reason}; point {key} at a writable folder")


# Why the other ZeRO stages are refused (schema.ZERO_STAGE is the one).
ZERO_STAGE_REFUSED = {
    0: "parallel.zero_stage=0: every run shards the optimizer state over DP (ZeRO-1): the same "
       "bytes on the wire as an all-reduce, 1/dp of the optimizer's memory, and at dp = 1 the "
       "same as no ZeRO; set parallel.zero_stage=1",
    2: "parallel.zero_stage=2: gradients are not sharded; every run keeps whole fp32 gradient "
       "buffers and shards the optimizer state (ZeRO-1, as Megatron-Core's distributed "
       "optimizer): 4 bytes per parameter more than ZeRO-2 at large dp, overlapped with "
       "backward; set parallel.zero_stage=1",
}


def check_config(config: Config) -> DataPlan:
    """Every check that needs neither the world size nor the file system: ranges and
    choices, whether the model can be built at parallel.tp x parallel.pp, the settings that
    depend on each other. Returns the data plan resolved on the way (schedules, the largest
    mask rate, P), which checks data.max_predictions against that rate."""
    check_ranges(config)
    par, train = config.parallel, config.train
    check_buildable(config.model, par.tp, par.pp)
    if par.zero_stage != ZERO_STAGE:
        raise ConfigError(ZERO_STAGE_REFUSED[par.zero_stage])
    if train.fp8:
        check_fp8(config)
    if config.eval.retrieval_path:
        check_retrieval(config)
    if config.data.seq_length > config.model.max_position_embeddings:
        raise ConfigError(
            f"data.seq_length={config.data.seq_length} exceeds "
            f"model.max_position_embeddings={config.model.max_position_embeddings}")
    from megatron_rembert.data.schedule import DataPlan  # numpy: not for --help

    return DataPlan.resolve(config.data, train.steps, config.eval.mask_prob)


def check_settings(config: Config) -> DataPlan:
    """Every check that needs no world size: `check_config`, and the paths (train.save_dir
    and train.log_dir writable, eval.retrieval_path's files readable). What train.py runs
    before any heavy import; returns `check_config`'s data plan, for the run plan
    (`RunPlan.build(..., data=)`)."""
    data = check_config(config)
    check_paths(config)
    if config.eval.retrieval_path:
        from megatron_rembert.data.parallel_text import read_parallel_set

        read_parallel_set(config.eval.retrieval_path, config.eval.retrieval_pairs)
    return data


def check_retrieval(config: Config) -> None:
    """eval.retrieval_*: what the periodic retrieval (training/retrieval.py) needs."""
    path, layers = config.eval.retrieval_path, config.model.num_hidden_layers
    if config.parallel.pp > 1:
        # The pooled layer lives on one pipeline stage: measuring it would take a forward
        # of our own through the stages beside DeepSpeed's schedule, for what the saved
        # checkpoints give offline at any layout.
        raise ConfigError(f"eval.retrieval_path={path} with parallel.pp={config.parallel.pp}: "
                          "retrieval during training needs pp = 1; leave eval.retrieval_path "
                          "empty and evaluate the saved checkpoints with rembert-eval")
    if not config.data.tokenizer:
        raise ConfigError(f"eval.retrieval_path={path} needs data.tokenizer (the run's "
                          "SentencePiece model encodes the sentences)")
    if not config.train.eval_interval:
        raise ConfigError(f"eval.retrieval_path={path} with train.eval_interval=0: retrieval "
                          "runs with the validation; set train.eval_interval")
    if config.eval.retrieval_layer > layers:
        raise ConfigError(f"eval.retrieval_layer={config.eval.retrieval_layer} exceeds "
                          f"model.num_hidden_layers={layers} (0 = the middle layer)")


def check_fp8(config: Config) -> None:
    """train.fp8: every Transformer linear's local GEMM in multiples of 16, and a GPU (if any)
    with fp8 tensor cores (compute capability 8.9: Ada, Hopper and later)."""
    from megatron_rembert.kernels.fp8 import GEMM_MULTIPLE

    model, tp = config.model, config.parallel.tp
    for key, size in (("model.hidden_size", model.hidden_size),
                      ("model.intermediate_size", model.intermediate_size)):
        if size % (GEMM_MULTIPLE * tp):
            raise ConfigError(f"train.fp8=true needs {key} / parallel.tp in multiples of "
                              f"{GEMM_MULTIPLE} (fp8 GEMMs), got {size} / {tp}; set "
                              "train.fp8=false or change the size")
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        raise ConfigError(f"train.fp8=true needs a GPU of compute capability >= 8.9 (Ada, "
                          f"Hopper or later); {torch.cuda.get_device_name()} has "
                          f"{major}.{minor}: set train.fp8=false")
