"""Checkpoints on disk: one home below both `training/` (which saves into and loads from the
DeepSpeed engine) and `convert/` (the CLI, the transformers mapping, resharding). Atomic
writes and hashing come from `megatron_rembert.fs`, which the data tools share.

- `files`: safetensors reading and streamed writing, guarded torch loads;
- `folder`: the step-folder protocol (`complete` marker, `latest`, `meta.json`, the integrity
  manifest, one completeness check, one atomic commit, pruning, roll-back) and the save_dir lock;
- `specs`: parameter specs (pipeline layer, TP split, vocabulary padding), one slice/merge pair;
- `portable`: the portable format, written and read here (documented in its docstring);
- `reader`: full tensors from a step folder of either kind, whatever its layout.

Every error raised here is a `CheckpointError` whose message names the file or folder.
This package imports nothing from `training/` or `convert/` (tests/checkpoint/test_imports.py).
"""

from megatron_rembert.errors import UserError


class CheckpointError(UserError):
    """A checkpoint that cannot be written or trusted; the message names the file and the fix."""
