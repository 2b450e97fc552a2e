"""The run plan: what follows from the checked config and the world size, resolved once.

    RunPlan.build(config, world_size, rank)
      check_config      every check that needs no world size (run_config/checks.py)
      data              the schedules, the largest mask rate and P (data.schedule.DataPlan)
      layout            tp x pp x dp, micro-batches per step, this rank (parallel.layout)
      stages            the pipeline split and each stage's FLOPs and memory per rank
                        (training.estimate.stage_plan; one stage at pp = 1)
      lr                the learning rate's warm-up, stable and decay stretches (training.optim)
      launch            the launcher's variables as train.py read them, once (launch_env.py);
                        None for a plan built without a launcher (--dry-run, tests)

Each rank builds it once at start-up (train.py, else `training.inputs.check_inputs`) and
hands it on: the loaders take `data`, the engine `layout`, `stages` and `lr`, the checkpoint
metadata the layout and the split, the process group and the save_dir lock `launch`,
`--dry-run` all of it. Nothing downstream derives these again.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rembert.data.schedule import DataPlan
from megatron_rembert.launch_env import LaunchEnv
from megatron_rembert.parallel.layout import Layout
from megatron_rembert.run_config.checks import check_config
from megatron_rembert.run_config.schema import Config
from megatron_rembert.training.estimate import StagePlan, stage_plan
from megatron_rembert.training.optim import LRSchedule


@dataclass(frozen=True)
class RunPlan:
    layout: Layout
    data: DataPlan
    stages: StagePlan
    lr: LRSchedule
    launch: LaunchEnv | None = None

    @classmethod
    def build(cls, config: Config, world_size: int, rank: int = 0,
              data: DataPlan | None = None, launch: LaunchEnv | None = None) -> RunPlan:
        """Check `config` (ConfigError naming the key) and resolve the run of `world_size`
        processes as seen from `rank`. `data`: what `check_config` (or `check_settings`)
        returned for this config when the caller ran it already; its checks are then done.
        `launch`: the launcher's variables this run was started with, kept in the plan."""
        data = data if data is not None else check_config(config)
        train = config.train
        layout = Layout.build(world_size, rank, tp=config.parallel.tp, pp=config.parallel.pp,
                              micro_batch_size=train.micro_batch_size,
                              global_batch_size=train.global_batch_size)
        return cls(layout=layout, data=data, stages=stage_plan(config, layout, data),
                   lr=LRSchedule.of(config), launch=launch)

    @property
    def stage_boundaries(self) -> list[int] | None:
        """Pipeline stage i owns pipeline layers [b_i, b_i+1) (0: the embedding, N + 1: the
        head); None at pp = 1. What the pipeline is built from and a checkpoint records."""
        return list(self.stages.boundaries) if self.layout.pp > 1 else None
