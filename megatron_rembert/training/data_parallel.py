"""The gradient path of every run: our gradient buffers and distributed optimizer, under
DeepSpeed's engine through its public API.

Runs train as Megatron-Core's DistributedDataParallel + DistributedOptimizer do:
- parallel/grad_buffer.py: fp32 main gradients in contiguous buffers (the embedding and the
  fused MLM loss add into them themselves, `summed_by_kernels`, and report it), reduce-scattered
  over DP in buckets, each starting while the last micro-batch's backward goes on (at pp > 1
  too: a bucket is complete once its gradients are in once per micro-batch);
- training/distributed_optimizer.py: each DP rank steps the fp32 masters and optimizer state
  of its shard (ZeRO-1), with clipping, fp16's loss scale (training/loss_scale.py) and the
  non-finite rule, then all-gathers the weights, in flight while the next forward runs
  (parallel.overlap_weight_gather).

DeepSpeed stays the engine users configure (`deepspeed.initialize`, its pipeline engine and
schedule) and gets our optimizer as a client optimizer, with everything it would otherwise do to
the gradients off (training/ds_config.py: ZeRO 0, its bf16/fp16 wrappers off, no clipping of
its own); the model is cast to the training dtype here, not by DeepSpeed. Its gradient all-reduce
is switched off by its public means: pp = 1 runs every backward inside `engine.no_sync()`,
pp > 1 sets `engine.pipeline_enable_backward_allreduce = False`, and every step fails if a
gradient reached a parameter outside our buffers, as DeepSpeed's own reduction would
(parallel/grad_buffer.py, `ForeignGradient`). After a client optimizer's step
the engine reads `optimizer.overflow` (a skipped step: counted, the LR schedule stands still).
DeepSpeed's own optimizers (its ZeRO, bf16 and fp16 wrappers) are constructed on no path.
"""

from __future__ import annotations

import torch

from megatron_rembert.checkpoint.files import DTYPES
from megatron_rembert.parallel.grad_buffer import GradBuffer
from megatron_rembert.run_config.schema import Config
from megatron_rembert.training.distributed_optimizer import DistributedOptimizer
from megatron_rembert.training.loss_scale import LossScaler
from megatron_rembert.training.optim import make_optimizer, param_groups


def weight_dtype(config: Config) -> torch.dtype:
    """The dtype of the weights the model computes with (train.precision); the masters,
    main gradients and optimizer state are fp32 in every precision."""
    return DTYPES[config.train.precision]


def loss_scaler(user_ds: dict, config: Config) -> LossScaler | None:
    """fp16's loss scaler, from the user's ds_config's `fp16` section (DeepSpeed's keys and
    defaults: training/ds_config.py `load_ds_config`); None in the other precisions."""
    if config.train.precision != "fp16":
        return None
    return LossScaler.from_ds_config(
        {k: v for k, v in user_ds.get("fp16", {}).items() if k != "enabled"},
        f"parallel.ds_config={config.parallel.ds_config or '(none)'}")


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


def build(named_params: list[tuple[str, torch.nn.Parameter]], config: Config,
          scaler: LossScaler | None = None) -> tuple[GradBuffer, DistributedOptimizer]:
    """The gradient buffers of this rank's parameters (already in the training dtype and on
    the device) and the distributed optimizer over them (with fp16's `scaler`)."""
    params = [p for _, p in named_params]
    buffer = GradBuffer(params, bucket_elements=config.parallel.grad_bucket_elements,
                        wire_dtype=DTYPES[config.parallel.grad_reduce_dtype],
                        summed_by_kernels=kernel_summed(named_params, config.model))
    for name, p in named_params:
        if p.requires_grad:
            buffer.name(p, name)
    optimizer = DistributedOptimizer(buffer, param_groups(named_params, config),
                                     make_optimizer(config), clip_grad=config.optim.clip_grad,
                                     loss_scaler=scaler)
    return buffer, optimizer
