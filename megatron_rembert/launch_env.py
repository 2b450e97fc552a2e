"""The launcher's variables (torchrun, SLURM via slurm/, tests' gloo ranks), read and checked
once, before any process group exists: values that are not integers or that contradict each
other are one `error:` line naming the variable, not a traceback or a rendezvous that waits
for ranks that will never come.

The one reader and the one writer of these variables in the package: `launch_env()` reads
them once (train.py, into the run plan; everything else takes them from there), and
`publish()` writes what torch's env:// rendezvous and DeepSpeed read back from the
environment. No other module reads them (tests/test_launch_env.py scans the source).

The ground floor: torch-free, importing nothing of the package but its error type.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_rembert.errors import UserError

NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")  # integers
# Every variable launch_env() reads: the integers, the rendezvous host, the SLURM job (a
# requeued job takes over its earlier incarnation's save_dir lock, checkpoint/lock.py).
READS = (*NAMES, "MASTER_ADDR", "SLURM_JOB_ID")
DEFAULT_PORT = 29500  # torch's own default for env:// rendezvous


class LaunchError(UserError):
    """The launcher's environment variables are not integers or contradict each other."""


@dataclass(frozen=True)
class LaunchEnv:
    rank: int = 0
    world_size: int | None = None  # None: not launched by a launcher (one process)
    local_rank: int = 0
    local_world_size: int | None = None  # ranks on this node, when the launcher says
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    slurm_job_id: str | None = None  # under SLURM: this job's id (the same after a requeue)


def _integer(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value.strip())
    except ValueError:
        raise LaunchError(f"launcher variable {name}={value!r}: not an integer; check how the "
                          "job is launched (torchrun, srun or the environment)") from None


def launch_env(env: Mapping[str, str] | None = None, default_port: int = DEFAULT_PORT
               ) -> LaunchEnv:
    """The checked launcher variables of `env` (default: this process's environment).
    `default_port`: the rendezvous port where MASTER_PORT is unset (one process)."""
    env = os.environ if env is None else env
    rank, world, local, local_world, port = (_integer(env, n) for n in NAMES)

    def refuse(what: str) -> LaunchError:
        shown = ", ".join(f"{n}={env[n]}" for n in NAMES if env.get(n, "").strip())
        return LaunchError(f"launcher variables {shown}: {what}; check how the job is "
                           "launched (torchrun, srun or the environment)")

    if world is not None and world < 1:
        raise refuse("WORLD_SIZE must be >= 1")
    if world is not None and world > 1 and rank is None:
        raise refuse("WORLD_SIZE > 1 without RANK")
    if rank is not None and not 0 <= rank < (world or 1):
        raise refuse(f"RANK must be in 0..{(world or 1) - 1} (below WORLD_SIZE)")
    if local_world is not None and not 1 <= local_world <= (world or 1):
        raise refuse("LOCAL_WORLD_SIZE must be in 1..WORLD_SIZE")
    if local is not None:
        if local < 0:
            raise refuse("LOCAL_RANK must be >= 0")
        if local_world is not None and local >= local_world:
            raise refuse("LOCAL_RANK must be below LOCAL_WORLD_SIZE")
        if local > (rank or 0):  # ranks are numbered node by node: local index <= global
            raise refuse("LOCAL_RANK cannot exceed RANK")
    if port is not None and not 1 <= port <= 65535:
        raise refuse("MASTER_PORT must be in 1..65535")
    return LaunchEnv(rank=rank or 0, world_size=world, local_rank=local or 0,
                     local_world_size=local_world,
                     master_addr=env.get("MASTER_ADDR", "").strip() or "127.0.0.1",
                     master_port=default_port if port is None else port,
                     slurm_job_id=env.get("SLURM_JOB_ID", "").strip() or None)


def publish(launch: LaunchEnv, local_rank: int | None = None) -> None:
    """Write `launch` into this process's environment, where torch's env:// rendezvous
    (MASTER_ADDR, MASTER_PORT) and DeepSpeed (RANK, WORLD_SIZE, LOCAL_RANK) read it back; a
    single process gets rank 0 of 1. `local_rank`: what DeepSpeed is to take as LOCAL_RANK, the
    index of the GPU this rank uses (DeepSpeed's engine and pipeline module bind to
    cuda:LOCAL_RANK; where ranks share GPUs that is not the launcher's LOCAL_RANK)."""
    os.environ.update(MASTER_ADDR=launch.master_addr, MASTER_PORT=str(launch.master_port),
                      RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size or 1),
                      LOCAL_RANK=str(launch.local_rank if local_rank is None else local_rank))
