"""DeepSpeed without its routine chatter, by its documented means: the accelerator named in
DS_ACCELERATOR before DeepSpeed is imported, and the one line its CPU communication op prints
on every start kept off the console.

On a machine without a GPU DeepSpeed's own detection settles on the CPU and warns "Setting
accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." on
every command; naming it (DS_ACCELERATOR=cpu, what it would choose) says nothing. This package
runs on CUDA or the CPU only (training.distributed.setup_distributed), the same test as here.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

# What `deepspeed.init_distributed` prints on a CPU once its shared-memory op is loaded
# ("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"), every start,
# from the cache too. Everything else it prints passes through.
_ROUTINE_SUFFIX = " built successfully"


def choose_accelerator() -> None:
    """Set DS_ACCELERATOR=cpu where torch sees no CUDA GPU and the variable is unset: call it
    before the first `import deepspeed` of the process (it imports torch)."""
    if "DS_ACCELERATOR" in os.environ:
        return  # the user's choice
    import torch

    if not (torch.cuda.device_count() > 0 and torch.cuda.is_available()):
        os.environ["DS_ACCELERATOR"] = "cpu"


def shm_op_build_note() -> str | None:
    """A line announcing DeepSpeed's one-time build of its shared-memory op for CPU
    communication, which `deepspeed.init_distributed` compiles on a machine's first CPU run
    (about 90 s on 2 cores; then loaded from torch's extension cache), or None when the cache
    has it."""
    from torch.utils.cpp_extension import get_default_build_root

    # torch builds extensions under TORCH_EXTENSIONS_DIR when set (cpp_extension.load's
    # documented rule), else under its default root
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    if any(root.glob("*/deepspeed_shm_comm/deepspeed_shm_comm*.so")):
        return None
    return ("start-up: DeepSpeed builds its shared-memory op for CPU communication (once per "
            f"machine, about 90 s on 2 cores; cached in {root})")


@contextlib.contextmanager
def routine_lines_dropped(write: Callable[[str], object] = sys.stdout.write) -> Iterator[None]:
    """Run the block with stdout captured; then write back every line but the op's routine
    "... built successfully" (all of them, when the block raises: then nothing is routine)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    except BaseException:
        write(captured.getvalue())
        raise
    kept = [line for line in captured.getvalue().splitlines(keepends=True)
            if not (line.startswith("DeepSpeed ") and line.rstrip().endswith(_ROUTINE_SUFFIX))]
    if kept:
        write("".join(kept))
