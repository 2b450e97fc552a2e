"""The process group: torch.distributed and DeepSpeed initialised from the launcher's
environment (or a single process), on the training device."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_rembert.config import check_choice
from megatron_rembert.deepspeed_env import routine_lines_dropped, shm_op_build_note
from megatron_rembert.launch_env import launch_env
from megatron_rembert.parallel import comm
from megatron_rembert.run_config import CHOICES


def setup_distributed(timeout_minutes: float = 10.0, backend: str = "auto"
                      ) -> tuple[int, int, torch.device]:
    """Initialise torch.distributed from torchrun's environment (or a single process), with
    `timeout_minutes` for every process group, ours and DeepSpeed's; collectives run on the
    training device (parallel.comm). Ranks beyond the node's GPU count share GPUs, which only
    gloo allows (`backend`: auto = nccl on GPUs, gloo on CPUs)."""
    import deepspeed

    check_choice("parallel.backend", backend, CHOICES["parallel.backend"])  # before the plan
    cuda = torch.cuda.is_available()
    local_rank = launch_env().local_rank  # the launcher's variables, checked
    device = (torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda
              else torch.device("cpu"))
    if cuda:
        torch.cuda.set_device(device)
        # DeepSpeed takes LOCAL_RANK as the GPU index (engine, pipeline module): where ranks
        # share GPUs, it must name the GPU this rank uses.
        os.environ["LOCAL_RANK"] = str(device.index)
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    timeout = comm.set_default_timeout(timeout_minutes)
    if not dist.is_initialized():
        # Our own init, which DeepSpeed's then leaves alone: DeepSpeed binds every rank to
        # cuda:LOCAL_RANK, which does not exist where ranks share GPUs. NCCL ranks are bound
        # to their GPU (eager communicator setup); gloo ranks to none.
        world = int(os.environ["WORLD_SIZE"])
        bind = cuda and backend == "nccl" and world > 1
        dist.init_process_group(backend, timeout=timeout, rank=int(os.environ["RANK"]),
                                world_size=world, device_id=device if bind else None)
    if device.type == "cpu" and dist.get_rank() == 0 and (note := shm_op_build_note()):
        print(note, flush=True)
    with routine_lines_dropped():  # DeepSpeed's "built successfully" line, every start
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    comm.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device
