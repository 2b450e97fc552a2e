"""The run's settings: dataclass sections, each field with its default and its `--help` text
(`config.setting`), and the values each setting may take (RANGES, CHOICES).

    model:    a preset name plus any ModelConfig field (`model.preset: rembert`)
    parallel: tp, pp, zero_stage, ds_config (extra DeepSpeed knobs), activation checkpointing
    data:     dataset folder, tokenizer, sequence length, sampling and masking, their schedules
    optim:    optimizer and learning-rate schedule
    train:    batch sizes, precision, steps, logging, checkpoints
    eval:     the per-language validation set, retrieval on held-out parallel text
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_rembert.config import (
    AT_LEAST_0,
    AT_LEAST_1,
    MODEL_CHOICES,
    MODEL_RANGES,
    POSITIVE,
    PROBABILITY,
    ModelConfig,
    Range,
    setting,
)
from megatron_rembert.data.config import DataConfig


@dataclass
class ParallelConfig:
    tp: int = setting(1, help="tensor-parallel size (ranks adjacent, one node)")
    pp: int = setting(1, help="pipeline stages; > 1 runs DeepSpeed's PipelineModule (1F1B)")
    zero_stage: int = setting(1, help=(
        "1: the optimizer state (fp32 masters, moments) sharded over DP, Megatron-Core's "
        "distributed optimizer; 0 and 2 are refused (say why)"))
    ds_config: str = setting(
        "",
        help=(
            "JSON with DeepSpeed's own services (timers, profiler, monitors) and fp16's loss "
            "scale; keys that do nothing here are refused; optional"))
    grad_bucket_elements: int = setting(
        40_000_000,
        help=("elements per gradient bucket: each bucket's DP reduce-scatter starts as soon "
              "as backward has produced its gradients"))
    grad_reduce_dtype: str = setting(
        "fp32",
        help=("what the DP gradient reduction sends: fp32 (a "
              "reduce-scatter), or bf16 summed in fp32 on arrival (an all-to-all: 4 instead of "
              "6 bytes per parameter on the wire per step, each rank's gradient rounded to "
              "bf16 once; 4 bytes per parameter of transient buffers)"))
    overlap_weight_gather: bool = setting(
        True,
        help=("the weights' DP all-gather runs during the next step's forward (issued at its "
              "start, after its blocking all-reduce); each layer waits for its own bucket only"))
    activation_checkpointing: bool = setting(False,
                                             help="recompute each Transformer layer in backward")
    stage_memory_gib: float = setting(
        0.0,
        help=(
            "Each pipeline stage's estimated memory per rank stays under this many GiB (0 = no "
            "cap); within it, stages are balanced by FLOPs (`--dry-run` prints the split)"))
    memory_check: bool = setting(
        True,
        help=(
            "Refuse to start when --dry-run's memory estimate per rank exceeds the machine's "
            "memory per rank (GPU memory on CUDA; host RAM on CPU, shared by the node's ranks); "
            "false: start anyway (the estimate is off for your setup)"))
    timeout_minutes: float = setting(
        10.0,
        help=(
            "A collective waiting longer than this fails, naming each rank's step and instruction"))
    backend: str = setting(
        "auto",
        help=(
            "auto: nccl on GPUs, gloo on CPUs; gloo on GPUs lets several ranks share one GPU "
            "(checks; not with pp > 1: gloo sends CPU tensors only)"))


@dataclass
class OptimConfig:
    name: str = setting("adamw", help="lamb: training/lamb.py, whole-parameter trust ratios")
    lr: float = setting(2e-4, help="peak learning rate, reached at the end of the warm-up")
    beta1: float = setting(0.9, help="Adam's (and LAMB's) first-moment decay")
    beta2: float = setting(0.999, help="Adam's (and LAMB's) second-moment decay")
    eps: float = setting(1e-6, help="Adam's (and LAMB's) denominator epsilon")
    weight_decay: float = setting(0.01,
                                  help="decoupled weight decay (not on biases and LayerNorms)")
    warmup_steps: int = setting(15_000, help="steps of linear warm-up from 0 to optim.lr")
    decay: str = setting("linear", help="from decay_start_step to min_lr at train.steps")
    decay_start_step: int = setting(
        0,
        help=(
            "0 = right after warm-up; later: warmup-stable-decay, lr held until this step"))
    min_lr: float = setting(0.0, help="at most lr")
    clip_grad: float = setting(1.0, help="global gradient-norm limit; 0 = no clipping")


@dataclass
class TrainConfig:
    steps: int = setting(1_760_000, help="optimizer steps of the whole run (the schedules' length)")
    micro_batch_size: int = setting(8, help="sequences per rank per forward/backward")
    global_batch_size: int = setting(2048, help="= micro_batch_size x gradient accumulation x DP")
    precision: str = setting("bf16", help="bf16 and fp16 need ZeRO stage 1 or 2")
    fp8: bool = setting(
        False,
        help=(
            "The Transformer layers' linears multiply in fp8 (parallel/fp8.py); weights, optimizer"
            " and checkpoints stay train.precision's. Needs compute capability >= 8.9 on CUDA and "
            "hidden and FFN sizes / tp in multiples of 16; a checkpoint resumes with it on or off"))
    seed: int = setting(1234,
                        help="seed of the initialisation, the data order, masking and dropout")
    log_interval: int = setting(
        10,
        help=(
            "steps between metric lines (console, metrics.jsonl, TensorBoard)"))
    eval_interval: int = setting(1000,
                                 help="validation (and eval.retrieval_path's retrieval); 0 = never")
    eval_batches: int = setting(
        10,
        help=(
            "at most this many global batches of validation per language (see eval.*)"))
    save_interval: int = setting(1000, help="0 = only at the end and on a signal")
    max_minutes: float = setting(
        0.0,
        help=(
            "Save and exit 0 at the first step boundary this many minutes after the process "
            "started (0 = off), as a stop signal does; `latest` names that step and the run "
            "resumes from it. Set it below the job's wall-time limit by a step and a save; the "
            "schedules stay by steps"))
    keep_last: int = setting(3,
                             help="checkpoints kept in save_dir (older step folders are deleted)")
    async_save: bool = setting(
        False,
        help=(
            "Write checkpoints in the background: the step waits only while the state is "
            "copied off the training buffers; the weights check (train.max_weight_abs, on "
            "the copy), files, hashes, manifest and `latest` follow in a thread, and a refused "
            "save stops the run at the next save or the end. A save waits for the previous "
            "one, the end of the run and a stop wait for the last; `latest` moves only when "
            "every rank's files are complete"))
    save_dir: str = setting("runs/checkpoints",
                            help="folder of the step_* checkpoints and `latest`")
    resume_from: str = setting(
        "",
        help=(
            "Roll back: resume from this step_* folder of save_dir; newer ones are moved aside."))
    log_dir: str = setting("runs/logs", help="folder of metrics.jsonl and the TensorBoard events")
    max_nonfinite_steps: int = setting(
        10,
        help=(
            "An applied step with a non-finite loss or gradient norm stops the run at once; steps "
            "whose update was skipped for a non-finite gradient norm (weights untouched; never "
            "saved) stop it after this many in a row, or when the run ends on one"))
    divergence_factor: float = setting(
        10.0,
        help=(
            "Stop when a step's loss exceeds this factor times the mean of the last "
            "train.divergence_window losses (0 = off, else above 1). 10 fires only on a broken "
            "model: late in training 10x the mean is worse than guessing uniformly, early it is "
            "far beyond any spike of a healthy run"))
    divergence_window: int = setting(
        100,
        help=(
            "Losses in train.divergence_factor's mean; the check waits until this many steps have "
            "run (after a resume too: the window is not saved)"))
    max_weight_abs: float = setting(
        1e4,
        help=(
            "Save (and move `latest`) only when every weight is finite and at most this in "
            "magnitude: trained weights stay within tens, a diverging run's grow without bound"))
    wandb_project: str = setting(
        "",
        help=(
            'Weights & Biases project ("" = off; wandb is imported only when set; '
            "WANDB_MODE=offline logs into train.log_dir/wandb without a network)"))


@dataclass
class EvalConfig:
    sequences_per_language: int = setting(
        256,
        help=(
            "validation sequences per language (fewer where a language has fewer), a fixed set"))
    mask_prob: float = setting(0.15,
                               help="validation mask rate, whatever the training schedule says")
    retrieval_path: str = setting(
        "",
        help=(
            'Folder of held-out parallel text, <lang>.jsonl ({"text": ..., "en": ...} per line) or'
            " <lang>.tsv (text TAB English): with each validation, retrieval accuracy@1 to and "
            'from English per language ("" = off; needs data.tokenizer and parallel.pp = 1)'))
    retrieval_pairs: int = setting(
        200,
        help=(
            "pairs per language: a fixed subset of larger sets, duplicates dropped (the pairs that"
            " rembert-eval --max-pairs picks at the same number)"))
    retrieval_layer: int = setting(
        0,
        help=(
            "Transformer layer whose output is mean-pooled, 1..model.num_hidden_layers; 0 = the "
            "middle one, (num_hidden_layers + 1) // 2 (rembert-eval's default layer too)"))


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    model_preset: str = "rembert"

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["model"] = {"preset": self.model_preset, **out["model"]}
        del out["model_preset"]
        return out


SECTIONS = {f.name: f for f in dataclasses.fields(Config) if f.name != "model_preset"}

# Every numeric setting and the values it may take (all finite), checked by check_ranges and
# shown by `train.py --help`. Settings that depend on each other are checked in check_settings.
RANGES: dict[str, Range] = {
    **{f"model.{name}": allowed for name, allowed in MODEL_RANGES.items()},
    "parallel.tp": AT_LEAST_1,
    "parallel.pp": AT_LEAST_1,
    "parallel.zero_stage": Range(0, 2),  # 0 and 2 pass here, to be refused saying why
    "parallel.grad_bucket_elements": AT_LEAST_1,
    "parallel.timeout_minutes": POSITIVE,
    "parallel.stage_memory_gib": AT_LEAST_0,
    "data.seq_length": Range(3),  # [CLS], one token, [SEP]
    "data.alpha": Range(0.0, 1.0),
    "data.mask_prob": Range(0.0, 1.0, low_open=True, high_open=True),
    "data.max_predictions": AT_LEAST_0,  # and <= data.seq_length
    "data.num_workers": AT_LEAST_0,
    "optim.lr": POSITIVE,
    "optim.beta1": PROBABILITY,
    "optim.beta2": PROBABILITY,
    "optim.eps": POSITIVE,
    "optim.weight_decay": AT_LEAST_0,
    "optim.warmup_steps": AT_LEAST_0,
    "optim.decay_start_step": AT_LEAST_0,  # and < train.steps
    "optim.min_lr": AT_LEAST_0,  # and <= optim.lr
    "optim.clip_grad": AT_LEAST_0,
    "train.steps": AT_LEAST_1,
    "train.micro_batch_size": AT_LEAST_1,
    "train.global_batch_size": AT_LEAST_1,
    "train.seed": Range(0, 2**32 - 1),  # numpy's seed range
    "train.log_interval": AT_LEAST_1,
    "train.eval_interval": AT_LEAST_0,
    "train.eval_batches": AT_LEAST_1,
    "train.save_interval": AT_LEAST_0,
    "train.max_minutes": AT_LEAST_0,
    "train.keep_last": AT_LEAST_1,
    "train.max_nonfinite_steps": AT_LEAST_1,
    "train.divergence_factor": AT_LEAST_0,  # 0 (off) or above 1
    "train.divergence_window": AT_LEAST_1,
    "train.max_weight_abs": POSITIVE,
    "eval.sequences_per_language": AT_LEAST_1,
    "eval.mask_prob": Range(0.0, 1.0, low_open=True, high_open=True),
    "eval.retrieval_pairs": Range(2),  # one pair would always be found
    "eval.retrieval_layer": AT_LEAST_0,  # and <= model.num_hidden_layers
}

# Every setting that takes one of a few values, and those values: checked by check_ranges,
# shown by `train.py --help`.
CHOICES: dict[str, tuple] = {
    **{f"model.{name}": allowed for name, allowed in MODEL_CHOICES.items()},
    "parallel.backend": ("auto", "nccl", "gloo"),
    "parallel.grad_reduce_dtype": ("fp32", "bf16"),
    "data.mask_schedule": ("step", "linear"),
    "optim.name": ("adamw", "lamb"),
    "optim.decay": ("linear", "cosine", "1-sqrt", "constant"),
    "train.precision": ("fp32", "bf16", "fp16"),
}

# The one ZeRO stage: every run shards the optimizer state over DP as Megatron-Core's
# distributed optimizer does (training/distributed_optimizer.py); run_config/checks.py refuses
# the others, saying why, and `convert reshard` writes it.
ZERO_STAGE = 1
