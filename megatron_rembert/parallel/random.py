"""Dropout RNG under tensor and pipeline parallelism.

Two streams, as in Megatron-LM:
- the default torch generator, seeded identically on all TP peers, for dropout on replicated
  activations (hidden states after a row-parallel all-reduce): every peer drops the same units;
- a per-TP-rank stream, entered with `tp_rng()`, for dropout on sharded activations (attention
  probabilities of this rank's heads): peers must draw different masks for different heads.
Both are offset by 100 x the pipeline stage (Megatron's offset): stages seeded alike would draw
the same random sequence, correlating the dropout masks of different layers.

The stream switch is one operator, `megatron_rembert::swap_rng_state`, so that it also works
inside a torch.compile'd Transformer layer: dynamo cannot trace `torch.set_rng_state`, but it
keeps a custom operator as one call in the graph, and the operator's `nondeterministic_seeded`
tag makes inductor (with `fallback_random`) run it in program order with the dropout draws.
"""

from __future__ import annotations

import torch

from megatron_rembert.parallel import state

# Offset separating the TP stream from the default stream of the same base seed.
_TP_SEED_OFFSET = 2718
# Seed offset per pipeline stage.
_PP_SEED_STRIDE = 100

# The TP stream's generator state per device type, while the default stream is in use.
_tp_states: dict[str, torch.Tensor] = {}


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, rng_state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(rng_state, device)
    else:
        torch.set_rng_state(rng_state)


# Defined with torch.library.define rather than torch.library.custom_op, whose `tags` argument
# needs torch >= 2.8.
torch.library.define("megatron_rembert::swap_rng_state", "(Tensor rng_state, str device) -> Tensor",
                     tags=(torch.Tag.nondeterministic_seeded,))


@torch.library.impl("megatron_rembert::swap_rng_state", "CompositeExplicitAutograd")
def _swap_rng_state(rng_state: torch.Tensor, device: str) -> torch.Tensor:
    """Make `rng_state` the state of `device`'s default generator; return the state it had
    (a uint8 CPU tensor, as torch.get_rng_state returns it)."""
    device = torch.device(device)
    previous = _get_state(device)
    _set_state(device, rng_state)
    return previous


@torch.library.register_fake("megatron_rembert::swap_rng_state")
def _(rng_state: torch.Tensor, device: str) -> torch.Tensor:
    return torch.empty_like(rng_state)  # a generator's state keeps its size


swap_rng_state = torch.ops.megatron_rembert.swap_rng_state


def seed_all(seed: int, device: torch.device | str = "cpu") -> None:
    """Seed the default stream (same on TP peers) and this rank's TP stream, both offset by
    this rank's pipeline stage."""
    _seed_streams(seed + _PP_SEED_STRIDE * state.get_state().pp_rank, device)


def _seed_streams(seed: int, device: torch.device | str) -> None:
    device = torch.device(device)
    torch.manual_seed(seed + _TP_SEED_OFFSET + state.tp_rank())  # seeds CPU and CUDA
    _tp_states[device.type] = _get_state(device)
    torch.manual_seed(seed)


def reset_tp_streams() -> None:
    """Forget every TP stream (parallel.reset.reset_process_state): the next use seeds it afresh."""
    _tp_states.clear()


def ensure_tp_stream(device: torch.device | str) -> None:
    """Seed the TP stream of `device` from the default seed if nothing has seeded it yet
    (a model used outside the trainer). Called before a compiled layer, which cannot seed."""
    device = torch.device(device)
    if device.type not in _tp_states:
        _seed_streams(torch.initial_seed(), device)


class tp_rng:  # noqa: N801 - used like the context-manager function it replaces
    """`with tp_rng(device):` runs the body on this TP rank's own RNG stream, then returns to
    the default stream. A class, not a generator function, so dynamo traces it."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def __enter__(self) -> None:
        ensure_tp_stream(self.device)
        self.default_state = swap_rng_state(_tp_states[self.device.type], str(self.device))

    def __exit__(self, *exc) -> None:
        _tp_states[self.device.type] = swap_rng_state(self.default_state, str(self.device))


def get_rng_states() -> dict:
    """Everything a checkpoint needs to resume dropout exactly."""
    out = {"cpu": torch.get_rng_state(), "tp": dict(_tp_states)}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["cpu"])
    _tp_states.clear()
    _tp_states.update(states["tp"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def checkpoint_safe(fn):
    """Wrap a function for activation checkpointing so that its recomputation in backward
    replays the TP stream's dropout masks and leaves the stream where it was.

    torch.utils.checkpoint restores the default generator itself; the TP stream lives outside
    it, so it is snapshotted here. The stream is put back in a `finally`: torch's
    non-reentrant checkpoint stops a recomputation with an exception once it has the saved
    tensors it needs (early stop), and the stream would otherwise stay where the replay
    stopped, so the next step's masks would repeat this layer's.
    """
    snapshot = {k: v.clone() for k, v in _tp_states.items()}
    calls = 0

    def run(*args):
        nonlocal calls
        current = {k: v.clone() for k, v in _tp_states.items()}
        _tp_states.update({k: v.clone() for k, v in snapshot.items()})
        try:
            return fn(*args)
        finally:
            if calls:  # a recomputation: the stream goes on from where the real forward left it
                _tp_states.clear()
                _tp_states.update(current)
            calls += 1

    return run
