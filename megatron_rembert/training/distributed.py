"""The process group: torch.distributed and DeepSpeed initialised from the launcher's
variables as read once (launch_env.py; a single process without a launcher), on the
training device."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rembert.config import check_choice
from megatron_rembert.deepspeed_env import routine_lines_dropped, shm_op_build_note
from megatron_rembert.launch_env import LaunchEnv, publish
from megatron_rembert.parallel import comm
from megatron_rembert.run_config.schema import CHOICES


def setup_distributed(launch: LaunchEnv, timeout_minutes: float = 10.0, backend: str = "auto"
                      ) -> tuple[int, int, torch.device]:
    """Initialise torch.distributed from the launcher's variables as read once (`launch`,
    launch_env.launch_env; a single process when no launcher set them), with
    `timeout_minutes` for every process group, ours and DeepSpeed's; collectives run on the
    training device (parallel.comm). Ranks beyond the node's GPU count share GPUs, which only
    gloo allows (`backend`: auto = nccl on GPUs, gloo on CPUs)."""
    import deepspeed

    check_choice("parallel.backend", backend, CHOICES["parallel.backend"])  # before the plan
    cuda = torch.cuda.is_available()
    device = (torch.device("cuda", launch.local_rank % torch.cuda.device_count()) if cuda
              else torch.device("cpu"))
    if cuda:
        torch.cuda.set_device(device)
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    # What torch's rendezvous and DeepSpeed read back from the environment; DeepSpeed takes
    # LOCAL_RANK as the GPU index (engine, pipeline module): where ranks share GPUs, it must
    # name the GPU this rank uses.
    publish(launch, device.index if cuda else None)
    timeout = comm.set_default_timeout(timeout_minutes)
    if not dist.is_initialized():
        # Our own init, which DeepSpeed's then leaves alone: DeepSpeed binds every rank to
        # cuda:LOCAL_RANK, which does not exist where ranks share GPUs. NCCL ranks are bound
        # to their GPU (eager communicator setup); gloo ranks to none.
        world = launch.world_size or 1
        bind = cuda and backend == "nccl" and world > 1
        dist.init_process_group(backend, timeout=timeout, rank=launch.rank, world_size=world,
                                device_id=device if bind else None)
    if device.type == "cpu" and dist.get_rank() == 0 and (note := shm_op_build_note()):
        print(note, flush=True)
    with routine_lines_dropped():  # DeepSpeed's "built successfully" line, every start
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    comm.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device
