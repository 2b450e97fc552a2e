"""`train.py --dry-run`: sizes, layout, per-rank memory and FLOPs per step, allocating nothing."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rembert.cli import format_table
from megatron_rembert.config import ConfigError
from megatron_rembert.data.loader import max_mask_prob
from megatron_rembert.data.masking import default_max_predictions
from megatron_rembert.data.schedule import Schedule
from megatron_rembert.model.partition import (
    balance_stages,
    one_f_one_b_efficiency,
    pipeline_layer_flops,
)
from megatron_rembert.model.pipeline import pipeline_layer_costs
from megatron_rembert.model.sizes import flops_per_token, parameter_counts
from megatron_rembert.parallel.layout import Layout
from megatron_rembert.run_config import Config, validate_config


@dataclass
class StagePlan:
    """The pipeline partition of a config and layout, and what each stage costs per rank."""

    boundaries: list[int]  # stage i owns pipeline layers [boundaries[i], boundaries[i+1])
    flops: list[float]  # training FLOPs per micro-batch, per stage
    parameters: list[float]  # per rank (TP shard)
    memory: list[dict[str, float]]  # bytes per rank: parameters, gradients, optimizer, acts
    efficiency: float  # 1F1B bound for the accumulation steps of a global batch

    def total_memory(self, stage: int) -> float:
        return sum(self.memory[stage].values())


# The per-rank memory terms of `--dry-run`, in the order printed.
MEMORY_KEYS = ("parameters", "gradients", "optimizer_states", "optimizer_step", "gradient_copy",
               "activations")


def _bytes_per_parameter(config: Config, layout: Layout) -> dict[str, float]:
    """Bytes per parameter at the peak of a step, as DeepSpeed (0.19) holds them; measured
    per term with a single-process engine (bench/full_scale.py checks the sum on the real
    model, rank by rank).

    - parameters: the training precision (DeepSpeed flattens them into one buffer per group).
    - gradients: the same precision, plus an fp32 accumulation buffer for bf16/fp16 (DeepSpeed's
      BF16_Optimizer or its ZeRO gradient-accumulation attribute); whole up to ZeRO-1, sharded
      over DP by ZeRO-2.
    - optimizer_states: Adam's two fp32 moments, and under ZeRO an fp32 master copy of the
      weights, which DeepSpeed's ZeRO optimizer keeps even when training in fp32 (it clones
      the flat fp32 weights); sharded over DP from ZeRO-1.
    - optimizer_step: under ZeRO with gradient accumulation, a micro-batch's fresh gradients
      while the accumulated ones are held (from the second micro-batch on); the flat fp32
      gradient partition a ZeRO step builds from the gradients is as large. Without ZeRO
      torch's fused AdamW steps in place.
    Not per parameter: `gradient_copy` (see `_largest_parameters`).
    """
    half = config.train.precision in ("bf16", "fp16")
    weight, zero, dp = (2 if half else 4), config.parallel.zero_stage, layout.dp
    optimizer_dp = dp if zero >= 1 else 1
    return {"parameters": weight,
            "gradients": (weight + (4 if half else 0)) / (dp if zero >= 2 else 1),
            "optimizer_states": ((4 if zero >= 1 else 0) + 8) / optimizer_dp,
            "optimizer_step": (4 if zero >= 1 else 0) / optimizer_dp}


def _largest_parameters(config: Config, layout: Layout) -> list[float]:
    """Per pipeline layer, the elements of its largest parameter on one rank (TP shard): under
    ZeRO, DeepSpeed's gradient-accumulation hook copies a fresh gradient into its fp32 buffer
    one parameter at a time, so a stage briefly holds one extra fp32 gradient of that size on
    top of the per-parameter terms (measured: the peak of a single-process engine rises by
    exactly the largest parameter's fp32 gradient; on rembert's last stage the output
    embedding shard, 0.78 GiB at tp 2)."""
    from megatron_rembert.checkpoint.specs import param_specs

    largest = [0.0] * (config.model.num_hidden_layers + 2)
    for spec in param_specs(config.model, layout.tp):
        numel = math.prod(spec.local_shape(layout.tp))
        largest[spec.layer] = max(largest[spec.layer], float(numel))
    return largest


def _activation_bytes(config: Config, layout: Layout) -> list[float]:
    """Bytes one micro-batch leaves in memory per pipeline layer until its backward.

    Transformer layers follow Korthikanti et al. 2022 ("Reducing activation recomputation"),
    without sequence parallelism: s*b*h*(10 + 24/t) bytes in 16-bit, doubled for fp32, plus
    the attention's S x S tensors, 5*a*s*s*b/t bytes (scores, probabilities, dropout mask),
    which only the `fused_softmax` backend stores: SDPA's fused kernels (FlashAttention and
    memory-efficient attention on CUDA, the flash kernel on CPU) keep one fp32 logsumexp per
    row instead (4*a*s*b/t bytes; measured on an H200: the rembert trainer's peak is 28.6 GiB,
    and counting the S x S tensors estimated 44.6). With activation checkpointing only the
    layer input (2*s*b*h) is kept. The embedding keeps its E_in and H outputs, the head its P
    gathered rows (H, E_out twice).
    """
    m, tp = config.model, layout.tp
    s, b, h, a = config.data.seq_length, layout.micro_batch_size, m.hidden_size, \
        m.num_attention_heads
    scale = 1 if config.train.precision in ("bf16", "fp16") else 2
    attention = (5 * a * s * s * b if m.attention_backend == "fused_softmax"
                 else 4 * a * s * b / scale)  # the logsumexp is fp32 in either precision
    layer = 2 * s * b * h if config.parallel.activation_checkpointing else \
        s * b * h * (10 + 24 / tp) + attention / tp
    embedding = 2 * s * b * (m.input_embedding_size + h)
    head = 2 * b * predictions_per_sequence(config) * (h + 2 * m.output_embedding_size)
    return [scale * x for x in [embedding] + [layer] * m.num_hidden_layers + [head]]


def predictions_per_sequence(config: Config) -> int:
    """P, the masked slots per sequence the head runs on: as the loader sizes them, from the
    largest mask rate of the schedule and validation."""
    data = config.data
    rate = max_mask_prob(data, config.train.steps, config.eval.mask_prob)
    return data.max_predictions or default_max_predictions(data.seq_length, rate)


def stage_plan(config: Config, layout: Layout) -> StagePlan:
    """Stages balanced by training FLOPs (model.partition.balance_stages), each under
    parallel.stage_memory_gib per rank if set. The trainer builds its pipeline from these
    boundaries; `--dry-run` prints them."""
    m, pp = config.model, layout.pp
    flops = [x * layout.micro_batch_size / layout.tp for x in pipeline_layer_flops(
        m, config.data.seq_length, predictions_per_sequence(config),
        config.parallel.activation_checkpointing)]
    params = [c / layout.tp for c in pipeline_layer_costs(m)]
    per_param = _bytes_per_parameter(config, layout)
    static = [p * sum(per_param.values()) for p in params]
    activations = _activation_bytes(config, layout)
    in_flight = [min(pp - i, layout.gas) for i in range(pp)]
    copy = [4 * x if config.parallel.zero_stage >= 1 else 0.0
            for x in _largest_parameters(config, layout)]
    cap = config.parallel.stage_memory_gib * 2**30 or None
    try:
        bounds = balance_stages(flops, static, activations, in_flight, cap, copy)
    except ValueError as err:
        raise ConfigError(f"parallel.stage_memory_gib={config.parallel.stage_memory_gib}: "
                          f"{err}") from err
    stages = [range(bounds[i], bounds[i + 1]) for i in range(pp)]
    stage_params = [sum(params[k] for k in r) for r in stages]
    memory = [{**{key: n * b for key, b in per_param.items()},
               "gradient_copy": max(copy[k] for k in stages[i]),
               "activations": in_flight[i] * sum(activations[k] for k in stages[i])}
              for i, n in enumerate(stage_params)]
    stage_flops = [sum(flops[k] for k in r) for r in stages]
    return StagePlan(boundaries=bounds, flops=stage_flops, parameters=stage_params,
                     memory=memory, efficiency=one_f_one_b_efficiency(stage_flops, layout.gas))


def memory_estimate(config: Config, layout: Layout) -> dict:
    """Bytes per rank on the pipeline stage that needs the most memory (see `stage_plan`)."""
    plan = stage_plan(config, layout)
    busiest = max(range(layout.pp), key=plan.total_memory)
    return {**plan.memory[busiest], "params_per_rank": plan.parameters[busiest]}


def dry_run_report(config: Config, world_size: int | None = None) -> str:
    """The `--dry-run` text for `world_size` processes (default: tp x pp, i.e. dp = 1)."""
    par = config.parallel
    layout = validate_config(config, world_size or par.tp * par.pp)
    counts = parameter_counts(config.model)
    flops = flops_per_token(config.model, config.data.seq_length, config.data.mask_prob)
    tokens = layout.global_batch_size * config.data.seq_length
    mem = memory_estimate(config, layout)
    gib = 2**30
    lines = [
        f"model {config.model_preset}: {counts.pretraining:,} parameters in pre-training "
        f"({counts.pretraining_with_pooler:,} with pooler), {counts.finetuning:,} in "
        "fine-tuning",
        f"layout: world {layout.world_size} = pp {layout.pp} x dp {layout.dp} x tp {layout.tp}; "
        f"ZeRO stage {par.zero_stage}; {config.train.precision}",
        f"batch: global {layout.global_batch_size} = micro {layout.micro_batch_size}"
        f" x accumulation {layout.gas} x dp {layout.dp}; {tokens:,} tokens per step",
        f"FLOPs per step: {flops['training'] * tokens:.3e} "
        f"({flops['training']:,.0f} per token, MLM head {flops['head_share']:.1%} of forward)",
        f"memory per rank (estimate, most loaded stage, {mem['params_per_rank']:,.0f} "
        "parameters):",
    ]
    for key in MEMORY_KEYS:
        lines.append(f"  {key:<17} {mem[key] / gib:8.2f} GiB")
    total = sum(mem[k] for k in MEMORY_KEYS)
    lines.append(f"  {'total':<17} {total / gib:8.2f} GiB")
    if layout.pp > 1:
        lines += stage_table(config, layout)
    lines.append(phase_table(config))
    return "\n".join(lines)


def phase_table(config: Config) -> str:
    """The schedules by phase: steps, mask rate, sampling alpha, languages entering, and the
    learning rate's warm-up, stable and decay stretches."""
    schedule, optim = Schedule(config.data, config.train.steps), config.optim
    rows = []
    for i, p in enumerate(schedule.phases):
        rate = (f"{p.mask_prob:g}" if p.mask_prob_end == p.mask_prob
                else f"{p.mask_prob:g} -> {p.mask_prob_end:g}")
        entering = sorted(lang for lang, s in schedule.language_start.items()
                          if p.first_step <= s < p.end_step and s > 0)
        rows.append([i, f"{p.first_step}-{p.end_step}", rate, f"{p.alpha:g}",
                     ", ".join(f"{lang}@{schedule.language_start[lang]}" for lang in entering)
                     or "-"])
    decay_start = max(optim.warmup_steps, optim.decay_start_step)
    lr = (f"learning rate: warm-up 0-{optim.warmup_steps}, peak {optim.lr:g} until step "
          f"{decay_start}, {optim.decay} decay to {optim.min_lr:g} at {config.train.steps}"
          if optim.decay != "constant" else
          f"learning rate: warm-up 0-{optim.warmup_steps}, then {optim.lr:g} constant")
    rate = max(schedule.max_mask_prob, config.eval.mask_prob)
    width = predictions_per_sequence(config)
    return "\n".join([f"schedule by phase (steps; P = {width} masked slots for the largest "
                      f"mask rate, {rate:g}; validation at {config.eval.mask_prob:g}):",
                      format_table(["phase", "steps", "mask rate", "alpha",
                                    "languages entering"], rows), lr])


def _layer_names(start: int, stop: int, num_layers: int) -> str:
    """Pipeline layers [start, stop) in words: 0 is the embedding, num_layers + 1 the head."""
    parts = ["embedding"] if start == 0 else []
    first, last = max(start, 1), min(stop, num_layers + 1)  # Transformer layers 1..N
    if last > first:
        parts.append(f"layers {first - 1}-{last - 2}" if last - first > 1 else
                     f"layer {first - 1}")
    if stop == num_layers + 2:
        parts.append("MLM head")
    return " + ".join(parts)


def stage_table(config: Config, layout: Layout) -> list[str]:
    """Per pipeline stage: its layers, FLOP share, parameters and memory per rank."""
    plan = stage_plan(config, layout)
    total = sum(plan.flops)
    lines = [f"pipeline stages (balanced by training FLOPs; 1F1B efficiency bound "
             f"{plan.efficiency:.1%} with {layout.gas} micro-batches per step):"]
    for i in range(layout.pp):
        start, stop = plan.boundaries[i], plan.boundaries[i + 1]
        lines.append(f"  stage {i}: {_layer_names(start, stop, config.model.num_hidden_layers):<34}"
                     f" FLOPs {plan.flops[i] / total:6.1%}  {plan.parameters[i]:>13,.0f} "
                     f"parameters  {plan.total_memory(i) / 2**30:7.2f} GiB")
    return lines
