"""Checkpoints on disk: one home below both `training/` (which saves into and loads from the
DeepSpeed engine) and `convert/` (the CLI, the transformers mapping, resharding). Atomic
writes and hashing come from `megatron_rembert.fs`, which the data tools share.

- `files`: safetensors reading and streamed writing, guarded torch loads;
- `step_folder`: the step-folder protocol (`complete` marker, `latest`, `meta.json`, the
  integrity manifest, one completeness check, one atomic commit, pruning, roll-back) and
  `StepFolder`, a folder with its meta, checked once where it is resolved and passed on;
- `lock`: the save_dir lock (one run per save folder);
- `specs`: parameter specs (pipeline layer, TP split, vocabulary padding), one slice/merge pair;
- `portable`: the portable format, written and read here (documented in its docstring);
- `optimizer_shards`: training/distributed_optimizer.py's state, a file per rank, read at
  another DP or TP size (not yet written by the trainer);
- `reader`: full tensors from a step folder of either kind, whatever its layout;
- `resume`: what a resume decides before the model is built, without the engine (the same
  run? how it loads at this layout, what changes, where the data continues).

Every error raised here is a `CheckpointError` whose message names the file or folder.
This package imports nothing from `training/` or `convert/` (tests/checkpoint/test_imports.py).
"""

from megatron_rembert.errors import UserError


class CheckpointError(UserError):
    """A checkpoint that cannot be written or trusted; the message names the file and the fix."""
