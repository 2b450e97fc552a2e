"""`train.py --dry-run`: the run plan in words (sizes, layout, per-rank memory, FLOPs per step,
the pipeline stages, the communication per step and the schedules), allocating nothing."""

from __future__ import annotations

from megatron_rembert.cli import format_table
from megatron_rembert.model.cost import model_flops
from megatron_rembert.model.sizes import parameter_counts
from megatron_rembert.run_config.schema import Config
from megatron_rembert.training.communication import (
    DP_PATH,
    stage_time,
)
from megatron_rembert.training.estimate import MEMORY_KEYS, memory_estimate
from megatron_rembert.training.links import LinkAssumptions
from megatron_rembert.training.plan import RunPlan


def dry_run_report(config: Config, plan: RunPlan, links: LinkAssumptions | None = None) -> str:
    """The `--dry-run` text of `config` run as `plan` (`RunPlan.build`), its communication at
    `links` (default: `LinkAssumptions()`)."""
    par, layout = config.parallel, plan.layout
    counts = parameter_counts(config.model)
    tokens = layout.global_batch_size * config.data.seq_length
    mem = memory_estimate(plan.stages)
    gib = 2**30
    lines = [
        f"model {config.model_preset}: {counts.pretraining:,} parameters in pre-training "
        f"({counts.pretraining_with_pooler:,} with pooler), {counts.finetuning:,} in "
        "fine-tuning",
        f"layout: world {layout.world_size} = pp {layout.pp} x dp {layout.dp} x tp {layout.tp}; "
        f"ZeRO stage {par.zero_stage}; {config.train.precision}",
        f"batch: global {layout.global_batch_size} = micro {layout.micro_batch_size}"
        f" x accumulation {layout.gas} x dp {layout.dp}; {tokens:,} tokens per step",
        *flops_lines(config, plan),
        f"memory per rank (estimate, most loaded stage, {mem['params_per_rank']:,.0f} "
        "parameters):",
    ]
    for key in MEMORY_KEYS:
        lines.append(f"  {key:<17} {mem[key] / gib:8.2f} GiB")
    total = sum(mem[k] for k in MEMORY_KEYS)
    lines.append(f"  {'total':<17} {total / gib:8.2f} GiB")
    if layout.pp > 1:
        lines += stage_table(config, plan)
    lines += communication_lines(config, plan, links or LinkAssumptions())
    lines.append(phase_table(plan))
    return "\n".join(lines)


def step_flops(config: Config, plan: RunPlan, step: int) -> dict[str, float]:
    """Model FLOPs (model/cost.py) of training step `step` of full rows, the MLM head at the
    masked tokens of the schedule's mask rate at that step."""
    rows, seq = plan.layout.global_batch_size, config.data.seq_length
    return model_flops(config.model, seq, rows, rows * plan.data.masked_per_row(seq, step))


def flops_lines(config: Config, plan: RunPlan) -> list[str]:
    """FLOPs per step at the first and the last step, and over the run (each phase counted
    from its first and last step: exact for a constant rate, the trapezoid for a linear one).
    """
    first, last = step_flops(config, plan, 0), step_flops(config, plan, config.train.steps - 1)
    total = 0.0
    for p in plan.data.schedule.phases:
        if p.end_step > p.first_step:
            ends = (step_flops(config, plan, p.first_step)["training"]
                    + step_flops(config, plan, p.end_step - 1)["training"])
            total += (p.end_step - p.first_step) * ends / 2
    per_token = first["training"] / (plan.layout.global_batch_size * config.data.seq_length)
    lines = [f"FLOPs per step (model FLOPs, the MLM head at the masked tokens of the step's "
             f"mask rate): {first['training']:.3e} at step 0 ({per_token:,.0f} per token, MLM "
             f"head {first['head_share']:.1%} of forward)"]
    if last["training"] != first["training"]:
        lines[0] += f", {last['training']:.3e} at the last step"
    lines.append(f"FLOPs of the run: {total:.3e} over {config.train.steps:,} steps")
    return lines


def phase_table(plan: RunPlan) -> str:
    """The schedules by phase: steps, mask rate, sampling alpha, languages entering, and the
    learning rate's warm-up, stable and decay stretches."""
    data, lr = plan.data, plan.lr
    schedule = data.schedule
    rows = []
    for i, p in enumerate(schedule.phases):
        rate = (f"{p.mask_prob:g}" if p.mask_prob_end == p.mask_prob
                else f"{p.mask_prob:g} -> {p.mask_prob_end:g}")
        entering = sorted(lang for lang, s in schedule.language_start.items()
                          if p.first_step <= s < p.end_step and s > 0)
        rows.append([i, f"{p.first_step}-{p.end_step}", rate, f"{p.alpha:g}",
                     ", ".join(f"{lang}@{schedule.language_start[lang]}" for lang in entering)
                     or "-"])
    text = (f"learning rate: warm-up 0-{lr.warmup_steps}, peak {lr.lr:g} until step "
            f"{lr.decay_start}, {lr.decay} decay to {lr.min_lr:g} at {lr.total_steps}"
            if lr.decay != "constant" else
            f"learning rate: warm-up 0-{lr.warmup_steps}, then {lr.lr:g} constant")
    return "\n".join([f"schedule by phase (steps; P = {data.max_predictions} masked slots for "
                      f"the largest mask rate, {data.max_mask_prob:g}; validation at "
                      f"{data.eval_mask_prob:g}):",
                      format_table(["phase", "steps", "mask rate", "alpha",
                                    "languages entering"], rows), text])


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


def stage_table(config: Config, plan: RunPlan) -> list[str]:
    """Per pipeline stage: its layers, FLOP share, parameters and memory per rank."""
    stages, layout = plan.stages, plan.layout
    total = sum(stages.flops)
    lines = [f"pipeline stages (balanced by training FLOPs; 1F1B efficiency bound "
             f"{stages.efficiency:.1%} with {layout.gas} micro-batches per step):"]
    for i in range(layout.pp):
        start, stop = stages.boundaries[i], stages.boundaries[i + 1]
        lines.append(f"  stage {i}: {_layer_names(start, stop, config.model.num_hidden_layers):<34}"
                     f" FLOPs {stages.flops[i] / total:6.1%}  {stages.parameters[i]:>13,.0f} "
                     f"parameters  {stages.total_memory(i) / 2**30:7.2f} GiB")
    return lines


def communication_lines(config: Config, plan: RunPlan, links: LinkAssumptions) -> list[str]:
    """Per rank and optimizer step (training/communication.py): the collectives of the busiest
    stage (the longest compute + exposed communication) as a table, one line per stage at
    pp > 1, and what is assumed."""
    times = [stage_time(config, plan, i, links) for i in range(plan.layout.pp)]
    busiest = max(times, key=lambda t: t.step_s)
    lines = ["communication per rank per step (bandwidth only, no latency; scalars left out):",
             f"  assumed: {links.intra_node_gbps:g} Gb/s per GPU within a node, "
             f"{links.inter_node_gbps:g} Gb/s across nodes, {links.gpus_per_node} GPUs per "
             f"node; matmuls at {links.mfu:.0%} of the {links.gpu}'s "
             f"{links.peak_flops / 1e12:g} TFLOP/s (--intra-node-gbps, --inter-node-gbps, "
             "--gpus-per-node, --assume-mfu, --gpu)",
             f"  DP gradient path: {DP_PATH}"]
    if plan.layout.pp > 1:
        for t in times:
            parts = []
            for g in ("TP", "PP", "DP"):
                mine = [(c, s) for c, s in zip(t.collectives, t.exposed_s, strict=True)
                        if c.group == g]
                parts.append(f"{g} {sum(c.wire_bytes for c, _ in mine) / 2**30:,.2f} GiB "
                             f"({sum(s for _, s in mine) * 1e3:,.1f} ms exposed)")
            lines.append(f"  stage {t.stage}: compute {t.compute_s * 1e3:,.1f} ms; "
                         + ", ".join(parts) + f"; exposed {t.total_exposed_s / t.step_s:.1%} "
                         "of its step")
        lines.append(f"stage {busiest.stage}, the longest step:")
    order = {"TP": 0, "PP": 1, "DP": 2}
    pairs = sorted(zip(busiest.collectives, busiest.exposed_s, strict=True),
                   key=lambda pair: order[pair[0].group])
    rows = [[c.group, c.size, "inter-node" if links.inter_node(c.ranks) else "intra-node",
             c.op, c.what, c.calls, f"{c.wire_bytes / 2**20:,.1f}",
             f"during {c.overlap}" if c.overlap != "none" else "no", f"{s * 1e3:,.2f}"]
            for c, s in pairs]
    if rows:
        lines.append(format_table(["group", "size", "link", "collective", "what", "calls",
                                   "MiB/step", "overlapped", "exposed ms"], rows))
    else:
        lines.append("  none: one rank per stage, no tensor or data parallelism")
    flops = plan.stages.flops[busiest.stage] * plan.layout.gas
    lines.append(f"compute {busiest.compute_s * 1e3:,.1f} ms ({flops:.3e} FLOPs per rank); "
                 "communication exposed "
                 f"{busiest.total_exposed_s * 1e3:,.1f} ms = "
                 f"{busiest.total_exposed_s / busiest.step_s:.1%} of the step"
                 + (" (compute + exposed; the pipeline's fill and drain not counted: see the "
                    "1F1B bound above)" if plan.layout.pp > 1 else ""))
    return lines
