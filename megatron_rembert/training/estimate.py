"""`train.py --dry-run`: sizes, layout, per-rank memory and FLOPs per step, allocating nothing."""

from __future__ import annotations

from megatron_rembert.data.common import format_table
from megatron_rembert.data.masking import default_max_predictions
from megatron_rembert.data.schedule import Schedule
from megatron_rembert.model.pipeline import pipeline_layer_costs
from megatron_rembert.model.sizes import flops_per_token, parameter_counts
from megatron_rembert.parallel.layout import Layout
from megatron_rembert.run_config import Config, validate_config


def _partition(costs: list[int], stages: int) -> list[list[int]]:
    """Contiguous split of layer costs into `stages` parts minimising the largest part."""
    lo, hi = max(costs), sum(costs)
    while lo < hi:  # binary search on the largest stage
        mid = (lo + hi) // 2
        parts, current = 1, 0
        for c in costs:
            if current + c > mid:
                parts, current = parts + 1, 0
            current += c
        lo, hi = (mid + 1, hi) if parts > stages else (lo, mid)
    out, current = [[]], 0
    for c in costs:
        if current + c > lo:
            out.append([])
            current = 0
        out[-1].append(c)
        current += c
    return out


def memory_estimate(config: Config, layout: Layout) -> dict:
    """Bytes per rank on the most loaded pipeline stage.

    Parameters and gradients in the training precision (fp32 master weights kept by the
    optimizer for bf16/fp16), Adam moments fp32; ZeRO-1 shards optimizer states, ZeRO-2 also
    gradients, over DP. bf16/fp16 gradients also accumulate in an fp32 buffer (DeepSpeed's
    BF16_Optimizer or its ZeRO gradient-accumulation attribute): whole up to ZeRO-1.
    Activations per Transformer layer and micro-batch follow Korthikanti et al. 2022
    ("Reducing activation recomputation"), without sequence parallelism:
    s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes in 16-bit; doubled for fp32; with full activation
    checkpointing only the layer input (2*s*b*h) is kept per layer. With 1F1B the first stage
    holds up to pp micro-batches in flight.
    """
    m, par, train = config.model, config.parallel, config.train
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    stages = _partition(pipeline_layer_costs(m), pp)
    params = max(sum(s) for s in stages) / tp
    half = train.precision in ("bf16", "fp16")
    weight_bytes = 2 if half else 4
    zero = par.zero_stage
    grads = params * (weight_bytes + (4 if half else 0)) / (dp if zero >= 2 else 1)
    optimizer = params * ((4 if half else 0) + 8) / (dp if zero >= 1 else 1)
    s, b, h, a = config.data.seq_length, layout.micro_batch_size, m.hidden_size, \
        m.num_attention_heads
    per_layer = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    if par.activation_checkpointing:
        per_layer = 2 * s * b * h
    layers_per_stage = -(-m.num_hidden_layers // pp)
    activations = per_layer * layers_per_stage * min(pp, layout.gas) * (1 if half else 2)
    return {"parameters": params * weight_bytes, "gradients": grads,
            "optimizer_states": optimizer, "activations": activations,
            "params_per_rank": params}


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
    for key in ("parameters", "gradients", "optimizer_states", "activations"):
        lines.append(f"  {key:<17} {mem[key] / gib:8.2f} GiB")
    total = sum(mem[k] for k in ("parameters", "gradients", "optimizer_states", "activations"))
    lines.append(f"  {'total':<17} {total / gib:8.2f} GiB")
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
    width = config.data.max_predictions or default_max_predictions(config.data.seq_length, rate)
    return "\n".join([f"schedule by phase (steps; P = {width} masked slots for the largest "
                      f"mask rate, {rate:g}; validation at {config.eval.mask_prob:g}):",
                      format_table(["phase", "steps", "mask rate", "alpha",
                                    "languages entering"], rows), lr])
