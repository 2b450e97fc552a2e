"""The production gradient path: our gradient buffers and distributed optimizer, under
DeepSpeed's engine through its public API.

Runs that `applies` to (ZeRO-1 in bf16 or fp32, the shipped configs) train as Megatron-Core's
DistributedDataParallel + DistributedOptimizer do:
- parallel/grad_buffer.py: fp32 main gradients in contiguous buffers (the embedding and the
  fused MLM loss add into them themselves, `summed_by_kernels`), reduce-scattered over DP in
  buckets, each starting while the last micro-batch's backward goes on (at pp > 1 too: a
  bucket is complete once its hooks ran once per micro-batch);
- training/distributed_optimizer.py: each DP rank steps the fp32 masters and optimizer state
  of its shard, with clipping and the non-finite rule, then all-gathers the weights, in
  flight while the next forward runs (parallel.overlap_weight_gather).

DeepSpeed stays the engine users configure (`deepspeed.initialize`, the ds_config JSON, its
pipeline engine and schedule) and gets our optimizer as a client optimizer: `engine_settings`
turns off everything it would otherwise do to the gradients (ZeRO 0, its bf16/fp16 wrappers off,
no clipping of its own); the model is cast to bf16 here, not by DeepSpeed. Its gradient
all-reduce is switched off by its public means: pp = 1 runs every backward inside
`engine.no_sync()`, pp > 1 sets `engine.pipeline_enable_backward_allreduce = False`. After a
client optimizer's step the engine reads `optimizer.overflow` (a skipped step: counted, the LR
schedule stands still). tests/training/test_client_optimizer.py shows DeepSpeed issues no
collective of its own on this path and steps the weights bitwise as our optimizer alone does.

fp16 (its loss scale) and ZeRO-2 keep DeepSpeed's own path.
"""

from __future__ import annotations

import torch

from megatron_rembert.checkpoint.files import DTYPES
from megatron_rembert.parallel.grad_buffer import GradBuffer
from megatron_rembert.run_config.checks import owns_gradient_path
from megatron_rembert.run_config.schema import Config
from megatron_rembert.training.distributed_optimizer import DistributedOptimizer
from megatron_rembert.training.optim import make_optimizer, param_groups


def applies(config: Config) -> bool:
    """Whether a run trains on this path: ZeRO-1 in bf16 or fp32."""
    return owns_gradient_path(config)


def summed_by_kernels(model_config) -> tuple[str, ...]:
    """Names (suffixes) of the parameters whose gradients kernels add into `main_grad`
    themselves: the input embedding (parallel/layers.py) and, with the fused loss, the output
    embedding and its bias (model/mlm_head.py). Autograd hands no gradient for them; the
    kernels report each addition to the buffer (parallel/grad_buffer.py)."""
    head = (("decoder.weight", "decoder.bias") if model_config.loss_backend == "fused" else ())
    return ("word_embeddings.weight", *head)


def kernel_summed(named_params: list[tuple[str, torch.nn.Parameter]], model_config
                  ) -> list[torch.nn.Parameter]:
    """The parameters of `named_params` (a model's, deduplicated) whose gradients kernels add,
    each as often as kernels add into it per backward pass: GradBuffer's `summed_by_kernels`.
    A table tied between the input embedding and the output projection is named once, yet
    both kernels add into it in every pass."""
    suffixes = summed_by_kernels(model_config)
    out = [p for name, p in named_params if p.requires_grad
           for suffix in suffixes if name.endswith(suffix)]
    if model_config.tie_embeddings and model_config.loss_backend == "fused":
        out += [p for name, p in named_params
                if p.requires_grad and name.endswith("word_embeddings.weight")]
    return out


def engine_settings(ds: dict) -> dict:
    """The DeepSpeed config of this path: the user's knobs, but nothing that touches the
    gradients or the weights' dtype (our optimizer does all of it)."""
    ds = dict(ds)
    ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "stage": 0}
    ds["bf16"] = {"enabled": False}
    ds["fp16"] = {"enabled": False}
    ds["gradient_clipping"] = 0.0
    ds.pop("data_types", None)  # accumulation and reduction dtypes: ours (fp32)
    ds.pop("communication_data_type", None)
    ds.pop("zero_allow_untested_optimizer", None)
    return ds


def build(named_params: list[tuple[str, torch.nn.Parameter]], config: Config
          ) -> tuple[GradBuffer, DistributedOptimizer]:
    """The gradient buffers of this rank's parameters (already in the training dtype and on
    the device) and the distributed optimizer over them."""
    params = [p for _, p in named_params]
    buffer = GradBuffer(params, bucket_elements=config.parallel.grad_bucket_elements,
                        wire_dtype=DTYPES[config.parallel.grad_reduce_dtype],
                        summed_by_kernels=kernel_summed(named_params, config.model))
    for name, p in named_params:
        if p.requires_grad:
            buffer.name(p, name)
    optimizer = DistributedOptimizer(buffer, param_groups(named_params, config),
                                     make_optimizer(config), clip_grad=config.optim.clip_grad)
    return buffer, optimizer
