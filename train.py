"""Pre-train a RemBERT-style encoder: `train.py --config configs/tiny.yaml [--set k=v ...]`.

Launch one process per GPU with torchrun (or SLURM, see slurm/); on CPU the ranks use gloo.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_rembert.config import ConfigError
from megatron_rembert.data.common import DataError
from megatron_rembert.training.checkpoint import CheckpointError
from megatron_rembert.training.config import config_help, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file with model/parallel/data/optim/train "
                        "sections (configs/*.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one key, repeatable: --set train.steps=20 "
                        "--set parallel.tp=2 (keys listed below)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print sizes, layout, per-rank memory and FLOPs per step; "
                        "allocate nothing and exit")
    parser.add_argument("--world-size", type=int,
                        default=int(os.environ.get("WORLD_SIZE", 0)) or None,
                        help="number of processes assumed by --dry-run (default: $WORLD_SIZE, "
                        "else tp x pp)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.set)
        if args.dry_run:
            from megatron_rembert.training.estimate import dry_run_report

            print(dry_run_report(config, args.world_size))
            return 0
        from megatron_rembert.training.loop import train

        summary = train(config)
    except (ConfigError, DataError, CheckpointError) as err:
        # Bad input: one clear line, no traceback (raised before any heavy work).
        print(f"error: {err}", file=sys.stderr)
        return 2
    if summary and int(os.environ.get("RANK", 0)) == 0:
        print(f"done at step {summary['step']}; checkpoints in {summary['save_dir']}, "
              f"metrics in {summary['log_dir']}/metrics.jsonl; "
              f"view with: tensorboard --logdir {summary['log_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
