"""The package's process-wide state is what parallel/state.py names, and reset_process_state()
returns all of it to a fresh process's. A new global (as fp8's optimizer hook and staleness
counter once were: every model of a process shared them) fails here until it is named and
reset there, or made the property of an object."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import megatron_rembert
from megatron_rembert.parallel import comm, random, state
from megatron_rembert.parallel.reset import reset_process_state

PACKAGE = Path(megatron_rembert.__file__).parent
# (module, name) of every `global` statement allowed: the parallel groups, the communication
# device, and the batch maker of a data-loader worker process (set by its initializer).
NAMED = {("parallel/state.py", "_STATE"), ("parallel/comm.py", "_DEVICE"),
         ("data/loader.py", "_MAKE")}
# torch's process-wide hook registries: a hook there runs for every model and optimizer.
GLOBAL_HOOKS = {"register_optimizer_step_pre_hook", "register_optimizer_step_post_hook",
                "register_module_forward_hook", "register_module_forward_pre_hook",
                "register_module_full_backward_hook", "register_module_backward_hook",
                "register_module_buffer_registration_hook",
                "register_module_parameter_registration_hook"}


def _package_sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


def test_every_global_is_named():
    found = {(name, g) for name, tree in _package_sources() for node in ast.walk(tree)
             if isinstance(node, ast.Global) for g in node.names}
    assert found == NAMED, f"unnamed process-wide state: {sorted(found - NAMED)}"


def test_no_process_wide_torch_hook():
    used = sorted({(name, getattr(node, "attr", getattr(node, "id", None)))
                   for name, tree in _package_sources() for node in ast.walk(tree)
                   if isinstance(node, (ast.Name, ast.Attribute))
                   and getattr(node, "attr", getattr(node, "id", None)) in GLOBAL_HOOKS})
    assert used == [], used


def test_reset_returns_the_process_to_a_fresh_ones():
    random.seed_all(5)  # seeds this rank's TP stream
    assert random.get_rng_states()["tp"]
    comm.set_device("meta")
    with state.offline(4, tp_rank=2):  # as a TP rank of 4
        assert state.tp_size() == 4
        reset_process_state()
        assert (state.tp_size(), state.tp_rank()) == (1, 0)
    assert comm.device() == torch.device("cpu")
    assert random.get_rng_states()["tp"] == {}
    with random.tp_rng("cpu"):  # the stream comes back at its next use
        torch.rand(1)
    assert set(random.get_rng_states()["tp"]) == {"cpu"}
    reset_process_state()
