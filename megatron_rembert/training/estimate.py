"""What a run costs per rank, allocating nothing: per-stage FLOPs and memory, and the pipeline
split balanced by them (`stage_plan`, which the run plan calls once; training/plan.py)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from megatron_rembert.config import ConfigError
from megatron_rembert.data.schedule import DataPlan
from megatron_rembert.model.cost import layer_parameters, parameter_table, pipeline_layer_flops
from megatron_rembert.model.partition import balance_stages, one_f_one_b_efficiency
from megatron_rembert.parallel.layout import Layout
from megatron_rembert.run_config.schema import Config
from megatron_rembert.training import data_parallel


@dataclass
class StagePlan:
    """The pipeline partition of a config and layout, and what each stage costs per rank."""

    boundaries: list[int]  # stage i owns pipeline layers [boundaries[i], boundaries[i+1])
    flops: list[float]  # training FLOPs per micro-batch, per stage
    layer_flops: list[float]  # ... per pipeline layer (what the stage split balanced)
    parameters: list[float]  # per rank (TP shard)
    memory: list[dict[str, float]]  # bytes per rank: parameters, gradients, optimizer, acts
    efficiency: float  # 1F1B bound for the accumulation steps of a global batch

    def total_memory(self, stage: int) -> float:
        return sum(self.memory[stage].values())


# The per-rank memory terms of `--dry-run`, in the order printed.
MEMORY_KEYS = ("parameters", "gradients", "optimizer_states", "optimizer_step", "transient_copy",
               "activations")


def _weight_bytes(config: Config) -> int:
    """Bytes of one weight (or activation) element in the training precision."""
    return 2 if config.train.precision in ("bf16", "fp16") else 4


def _bytes_per_parameter(config: Config, layout: Layout) -> dict[str, float]:
    """Bytes per parameter at the peak of a step, as the trainer holds them; measured per term
    with a single-process engine (bench/full_scale.py checks the sum on the real model, rank by
    rank).

    - parameters: the training precision (one buffer).
    - gradients: one fp32 buffer (training/data_parallel.py), autograd's gradients freed
      parameter by parameter as they are added (with parallel.grad_reduce_dtype=bf16 at
      dp > 1, 4 bytes more: the buckets' bf16 copies and receive buffers).
    - optimizer_states: Adam's two fp32 moments, and in bf16 or fp16 an fp32 master copy of
      the weights (in fp32 the master shard is the weights' own), sharded over DP (ZeRO-1).
    - optimizer_step: nothing: the distributed optimizer steps in place.
    Not per parameter: `transient_copy` (see `_transient_copy`).
    """
    weight, dp = _weight_bytes(config), layout.dp
    half = weight == 2
    # bf16 on the wire: each bucket's bf16 copy and receive buffer, all in flight at the end
    # of backward at worst
    wire = 4 if config.parallel.grad_reduce_dtype == "bf16" and dp > 1 else 0
    return {"parameters": weight, "gradients": 4 + wire,
            "optimizer_states": ((4 if half else 0) + 8) / dp, "optimizer_step": 0}


def _transient_copy(config: Config, layout: Layout) -> list[float]:
    """Per pipeline layer, the bytes of the largest copy a rank holds for a moment on top of the
    other terms while that layer is worked on (measured: each shows as the peak's excess over
    the other terms, bench/full_scale.py):
    a fresh gradient of the layer's largest parameter (TP shard) being added into the
    accumulated ones: autograd's gradient, in the training precision, lives until its hook has
    added it; the embeddings' gradients are added by their kernels and never exist whole. A
    resume and a save work in place (training/checkpoint.py)."""
    weight = _weight_bytes(config)
    skip = data_parallel.summed_by_kernels(config.model)
    fresh = [0.0] * (config.model.num_hidden_layers + 2)
    for param in parameter_table(config.model, layout.tp):
        if not param.name.endswith(skip):
            fresh[param.layer] = max(fresh[param.layer], weight * param.local)
    return fresh


def _activation_bytes(config: Config, layout: Layout, predictions: int) -> list[float]:
    """Bytes one micro-batch leaves in memory per pipeline layer until its backward.

    Transformer layers follow Korthikanti et al. 2022 ("Reducing activation recomputation"),
    without sequence parallelism: s*b*h*(10 + 24/t) bytes in 16-bit, doubled for fp32, plus
    the attention's S x S tensors, 5*a*s*s*b/t bytes (scores, probabilities, dropout mask),
    which only the `fused_softmax` backend stores: SDPA's fused kernels (FlashAttention and
    memory-efficient attention on CUDA, the flash kernel on CPU) keep one fp32 logsumexp per
    row instead (4*a*s*b/t bytes; measured on an H200: the rembert trainer's peak is 28.6 GiB,
    and counting the S x S tensors estimated 44.6). With activation checkpointing only the
    layer input (2*s*b*h) is kept. The embedding keeps its E_in and H outputs, the head its
    `predictions` (P) gathered rows (H, E_out twice).
    """
    m, tp = config.model, layout.tp
    s, b, h, a = config.data.seq_length, layout.micro_batch_size, m.hidden_size, \
        m.num_attention_heads
    scale = _weight_bytes(config) // 2
    attention = (5 * a * s * s * b if m.attention_backend == "fused_softmax"
                 else 4 * a * s * b / scale)  # the logsumexp is fp32 in either precision
    layer = 2 * s * b * h if config.parallel.activation_checkpointing else \
        s * b * h * (10 + 24 / tp) + attention / tp
    embedding = 2 * s * b * (m.input_embedding_size + h)
    head = 2 * b * predictions * (h + 2 * m.output_embedding_size)
    return [scale * x for x in [embedding] + [layer] * m.num_hidden_layers + [head]]


def stage_plan(config: Config, layout: Layout, data: DataPlan) -> StagePlan:
    """Stages balanced by training FLOPs (model.partition.balance_stages), each under
    parallel.stage_memory_gib per rank if set (one stage at pp = 1: what the rank holds).
    The run plan calls it once; the trainer builds its pipeline from its boundaries and
    `--dry-run` prints them.

    The head's cost: its dense and its activations grow with P, the slots of a sequence,
    which validation's rate (eval.mask_prob) widens where it is the largest; the output
    projection, most of its FLOPs, runs with the fused loss on the real masked tokens only,
    counted at the schedule's largest training rate (the split holds for the most expensive
    phase)."""
    m, pp, seq = config.model, layout.pp, config.data.seq_length
    flops = [x * layout.micro_batch_size / layout.tp for x in pipeline_layer_flops(
        m, seq, data.max_predictions, config.parallel.activation_checkpointing,
        masked=data.training_masked_per_row(seq))]
    params = [float(n) for n in layer_parameters(m, layout.tp, local=True)]
    per_param = _bytes_per_parameter(config, layout)
    static = [p * sum(per_param.values()) for p in params]
    activations = _activation_bytes(config, layout, data.max_predictions)
    in_flight = [min(pp - i, layout.gas) for i in range(pp)]
    copy = _transient_copy(config, layout)
    cap = config.parallel.stage_memory_gib * 2**30 or None
    try:
        bounds = balance_stages(flops, static, activations, in_flight, cap, copy)
    except ValueError as err:
        raise ConfigError(f"parallel.stage_memory_gib={config.parallel.stage_memory_gib}: "
                          f"{err}") from err
    stages = [range(bounds[i], bounds[i + 1]) for i in range(pp)]
    stage_params = [sum(params[k] for k in r) for r in stages]
    memory = [{**{key: n * b for key, b in per_param.items()},
               "transient_copy": max(copy[k] for k in stages[i]),
               "activations": in_flight[i] * sum(activations[k] for k in stages[i])}
              for i, n in enumerate(stage_params)]
    stage_flops = [sum(flops[k] for k in r) for r in stages]
    return StagePlan(boundaries=bounds, flops=stage_flops, layer_flops=flops,
                     parameters=stage_params,
                     memory=memory, efficiency=one_f_one_b_efficiency(stage_flops, layout.gas))


def memory_estimate(stages: StagePlan) -> dict:
    """Bytes per rank on the pipeline stage that needs the most memory."""
    busiest = max(range(len(stages.memory)), key=stages.total_memory)
    return {**stages.memory[busiest], "params_per_rank": stages.parameters[busiest]}


# -- the estimate against the machine ---------------------------------------------------------
def machine_memory_per_rank(local_rank: int, local_world_size: int) -> tuple[float, str]:
    """Bytes of memory one rank of this node can have, and what they are, in words: the GPU's
    memory shared by the ranks that use it (ranks beyond the GPU count share GPUs), or on CPU
    the host's RAM (or the container's limit, if lower) shared by the node's ranks."""
    import torch

    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        index = local_rank % gpus
        sharing = math.ceil(local_world_size / gpus)
        total = torch.cuda.get_device_properties(index).total_memory
        return total / sharing, (f"GPU memory of cuda:{index} ({total / 2**30:.1f} GiB, "
                                 f"{sharing} rank(s) on it)")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # a container's limit (cgroup v2), when it is lower
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        total = min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        pass
    return total / local_world_size, (f"host RAM ({total / 2**30:.1f} GiB, "
                                      f"{local_world_size} rank(s) on this node)")


def memory_verdict(stages: StagePlan, local_rank: int, local_world_size: int
                   ) -> tuple[bool, str]:
    """Whether `--dry-run`'s per-rank estimate fits this machine, and one sentence saying so."""
    mem = memory_estimate(stages)
    need = sum(mem[k] for k in MEMORY_KEYS)
    have, what = machine_memory_per_rank(local_rank, local_world_size)
    fits = need <= have
    return fits, (f"the run needs about {need / 2**30:.2f} GiB per rank (--dry-run's estimate "
                  f"for the most loaded stage) and this machine has {have / 2**30:.2f} GiB per "
                  f"rank: {what}")


def check_memory(config: Config, stages: StagePlan, local_rank: int, local_world_size: int
                 ) -> None:
    """Refuse a run whose estimate cannot fit before anything is allocated (unless
    parallel.memory_check=false): it would otherwise die minutes later in an out-of-memory
    error, or push the host into swap."""
    if not config.parallel.memory_check:
        return
    fits, said = memory_verdict(stages, local_rank, local_world_size)
    if not fits:
        raise ConfigError(f"{said}; lower train.micro_batch_size or data.seq_length, raise "
                          "parallel.tp or parallel.pp, or set "
                          "parallel.activation_checkpointing=true (`--dry-run` shows the "
                          "effect); parallel.memory_check=false starts anyway")
