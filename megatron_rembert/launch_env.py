"""The launcher's variables (torchrun, SLURM via slurm/, tests' gloo ranks), read and checked
once, before any process group exists: values that are not integers or that contradict each
other are one `error:` line naming the variable, not a traceback or a rendezvous that waits
for ranks that will never come.

The ground floor: torch-free, importing nothing of the package but its error type.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_rembert.errors import UserError

NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")


class LaunchError(UserError):
    """The launcher's environment variables are not integers or contradict each other."""


@dataclass(frozen=True)
class LaunchEnv:
    rank: int = 0
    world_size: int | None = None  # None: not launched by a launcher (one process)
    local_rank: int = 0
    local_world_size: int | None = None  # ranks on this node, when the launcher says


def _integer(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value.strip())
    except ValueError:
        raise LaunchError(f"launcher variable {name}={value!r}: not an integer; check how the "
                          "job is launched (torchrun, srun or the environment)") from None


def launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """The checked launcher variables of `env` (default: this process's environment)."""
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
                     local_world_size=local_world)
