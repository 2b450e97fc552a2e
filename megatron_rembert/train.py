"""Pre-train a RemBERT-style encoder: `rembert-train --config configs/tiny.yaml [--set k=v ...]`
(or `python train.py ...` from a checkout).

Launch one process per GPU with torchrun (or SLURM, see slurm/); on CPU the ranks use gloo.

Exit codes: 0 done, or stopped by SIGTERM / SIGUSR1 / Ctrl-C after saving at the step
boundary (during start-up: nothing to save yet); 2 bad settings or input (one `error:` line,
before any heavy work), or a run that diverged or ended on steps whose update was not applied
(one `error:` line on every rank naming the last good step and the step `latest` keeps;
training/divergence.py); 130 a second Ctrl-C after a first, before the save is done (no
save; the last complete checkpoint is kept; signals after the save change nothing); 1 a failed
write (one `error:` line naming the file), a peer rank that died, froze or stopped on its own
error (one line naming this rank's position), or anything else.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

# The standard library and the stop handler's module only (it imports nothing else): main()
# installs the handler before any other import of this package, torch's or DeepSpeed's.
from megatron_rembert.training.signals import StopFlag


def main(argv: list[str] | None = None) -> int:
    """Bad settings or input: one `error:` line and exit 2 (`cli.run_cli`).

    Stop signals are remembered from the first line on (training/signals.py): a stop during
    start-up, even during `import torch`, exits 0 with nothing to save. Once training has
    begun, the end of this call settles them: they are ignored until the process is gone (a
    signal while the rank exits is not a kill); a call that ends before (--help, --dry-run,
    bad settings) puts the old ones back."""
    stop = StopFlag()
    from megatron_rembert.cli import run_cli

    try:
        return run_cli(lambda args: _main(args, stop), argv)
    finally:
        if stop.in_use:
            stop.settle()
        else:
            stop.restore()


def _main(argv: list[str] | None, stop: StopFlag) -> int:
    import argparse
    import importlib.util

    from megatron_rembert.config import ConfigError
    from megatron_rembert.launch_env import launch_env
    from megatron_rembert.run_config.checks import check_settings
    from megatron_rembert.run_config.help import config_help
    from megatron_rembert.run_config.load import load_config

    parser = argparse.ArgumentParser(
        description=__doc__, epilog=config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file with model/parallel/data/optim/train/"
                        "eval sections (configs/*.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one key, repeatable: --set train.steps=20 "
                        "--set parallel.tp=2 (keys listed below)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print sizes, layout, per-rank memory, FLOPs and communication "
                        "per step; allocate nothing and exit")
    parser.add_argument("--world-size", type=int,
                        help="number of processes assumed by --dry-run (default: $WORLD_SIZE, "
                        "else tp x pp)")
    from megatron_rembert.training.links import FLAGS, LinkAssumptions  # torch-free

    assumed = parser.add_argument_group(
        "--dry-run's communication estimate (training/communication.py)")
    for field, (flag, kind, what) in FLAGS.items():
        assumed.add_argument(flag, type=kind, dest=field,
                           help=f"{what} (default {getattr(LinkAssumptions, field)})")
    args = parser.parse_args(argv)
    launch = launch_env()  # the launcher's variables, checked before anything uses them
    config = load_config(args.config, args.set)
    # Every check that needs no world size, before torch.distributed, DeepSpeed or the model.
    data_plan = check_settings(config)
    if config.parallel.ds_config:  # read and checked here, --dry-run included
        from megatron_rembert.training.ds_config import load_ds_config

        load_ds_config(config)
    if config.train.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"train.wandb_project={config.train.wandb_project}: wandb is not "
                          "installed; pip install wandb, or leave train.wandb_project empty")
    if args.world_size is not None and args.world_size < 1:
        raise ConfigError(f"--world-size {args.world_size}: must be >= 1")
    stated = {field: getattr(args, field) for field in FLAGS
              if getattr(args, field) is not None}
    if stated and not args.dry_run:
        raise ConfigError(f"{FLAGS[next(iter(stated))][0]}: only with --dry-run (it states what "
                          "the communication estimate assumes)")
    if args.dry_run:  # checked before the plan: a ConfigError naming the flag
        links = LinkAssumptions(**stated)
    from megatron_rembert.training.estimate import check_memory, memory_verdict
    from megatron_rembert.training.plan import RunPlan

    par = config.parallel
    world = (args.world_size if args.dry_run else None) or launch.world_size
    # The run plan, resolved once: a real run's is this rank's (the launcher's RANK) and
    # keeps the launcher's variables; the training loop takes it as it is.
    plan = RunPlan.build(config, world or (par.tp * par.pp if args.dry_run else 1),
                         0 if args.dry_run else launch.rank, data=data_plan,
                         launch=None if args.dry_run else launch)
    local_world = launch.local_world_size or 1  # ranks on this node, as the launcher says
    if args.dry_run:
        from megatron_rembert.training.dry_run import dry_run_report

        print(dry_run_report(config, plan, links))
        fits, said = memory_verdict(plan.stages, launch.local_rank, local_world)
        print(f"{said}: {'fits' if fits else 'does NOT fit; training would refuse to start'}"
              f"{'' if fits else ' (parallel.memory_check=false starts anyway)'}")
        return 0
    # Sizes that cannot fit are refused here, before torch.distributed and the model.
    check_memory(config, plan.stages, launch.local_rank, local_world)
    stop.in_use = True
    from megatron_rembert.deepspeed_env import choose_accelerator
    from megatron_rembert.training.startup import STARTUP  # torch-free

    STARTUP.enable(launch.rank == 0)
    STARTUP.mark("settings")  # since the process started: parsing, loading, checking
    choose_accelerator()  # before DeepSpeed's import: no "Setting accelerator to CPU" warning
    from megatron_rembert.training.loop import train  # torch, DeepSpeed, the model

    STARTUP.mark("training imports")
    from megatron_rembert.training.divergence import DivergenceError

    try:
        summary = train(config, stop, plan)
    except DivergenceError:
        # Every rank raises it at the same agreed step, with no collective in flight: its
        # process groups can end as on a finished run (left to the interpreter's teardown,
        # about one such run in a dozen was killed by SIGABRT after its error line).
        end_process_groups()
        raise
    end_process_groups()
    if not summary.get("stopped") and launch.rank == 0:
        print(f"done at step {summary['step']}; checkpoints in {summary['save_dir']}, "
              f"metrics in {summary['log_dir']}/metrics.jsonl; "
              f"view with: tensorboard --logdir {summary['log_dir']}")
    return 0


def console_main(argv: list[str] | None = None) -> None:
    """`rembert-train` and `python train.py`: `main`, then the process ends at once with its
    exit code, without the interpreter's teardown. By then the run has closed its logs, waited
    for its last save and ended its process groups (on a clean end, a stop or a divergence);
    what the teardown would still do is free gloo's backends, whose worker threads may still
    be releasing the last collective's tensors, which needs the interpreter the teardown is
    taking down. Under load about one run in a few dozen was killed that way by SIGABRT
    ("terminate called without an active exception", exit 134) after ending cleanly, which a
    scheduler reads as a failure. An unexpected exception (a bug) still ends the usual way,
    with its traceback."""
    exit_now(main(argv))


def exit_now(code: int) -> NoReturn:
    """End this process with `code` at once, its output flushed, without the interpreter's
    teardown (see `console_main`). For every program that ran process groups: train.py and the
    benches."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_process_groups() -> None:
    """torch's documented end of a rank, done, stopped or diverged: its process groups are
    destroyed while everything they use still exists. Left to the interpreter's teardown, a
    rank that stopped during start-up once aborted after its clean stop ("terminate called
    without an active exception", exit 134) and torchrun then killed the others. Not on other
    errors: a rank failing alone may leave its peers inside a collective, and ending a group
    then can wait on them (torchtitan ends its groups only after a clean run for this reason)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    console_main()
