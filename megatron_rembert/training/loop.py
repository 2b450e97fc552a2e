"""The training loop: start-up in order (rendezvous, checks, resume decision, model, engine,
resume, loader), then the steps with their metrics, validation, checkpoints and stop signals.

Each start-up idea lives in its own module: distributed (the process group), inputs (the
cheaper checks), save_dir (run meta, the lock, the resume decision), validation."""

from __future__ import annotations

import time

import torch

from megatron_rembert.checkpoint import resume
from megatron_rembert.data.loader import build_pretraining_loader
from megatron_rembert.errors import RunError
from megatron_rembert.launch_env import LaunchEnv, launch_env
from megatron_rembert.model.cost import model_flops
from megatron_rembert.parallel import random as tp_random
from megatron_rembert.parallel import state
from megatron_rembert.run_config.schema import Config
from megatron_rembert.training import checkpoint as ckpt
from megatron_rembert.training.distributed import setup_distributed
from megatron_rembert.training.divergence import DivergenceCheck, DivergenceError, stop_message
from megatron_rembert.training.hang import POSITION, Watchdog, describe, is_collective_failure
from megatron_rembert.training.inputs import check_inputs
from megatron_rembert.training.metrics import (
    MetricsLogger,
    RunAverage,
    StepClock,
    format_line,
    memory_gib,
    peak_flops,
)
from megatron_rembert.training.plan import RunPlan
from megatron_rembert.training.save_dir import find_resume, run_meta, save_dir_locked
from megatron_rembert.training.signals import PROCESS_START, StopFlag
from megatron_rembert.training.startup import STARTUP
from megatron_rembert.training.validation import evaluate


class TrainingError(RunError):
    """The run cannot go on (a peer died or froze, the losses stopped being finite): one
    `error:` line naming this rank's position, exit 1 (cli.run_cli)."""


def train(config: Config, stop: StopFlag | None = None, plan: RunPlan | None = None) -> dict:
    """Run (or resume) training; returns a summary of where everything went.

    `stop`: the stop-signal flag (training/signals.py), installed here if not given; train.py
    installs it before its heavy imports. `plan`: this rank's run plan, when the caller
    resolved it already (train.py does, for its memory check, with the launcher's variables
    it read); built here otherwise, from the launcher's variables read here, once.

    A collective that times out or breaks (a peer hung, died or stopped on its own error)
    ends the run with one line naming this rank's position (step, phase, micro-batch or
    pipeline instruction) and what torch said, on every rank that saw it.
    """
    stop = stop or StopFlag()
    stop.set_time_limit(config.train.max_minutes)
    launch = plan.launch if plan is not None and plan.launch is not None else launch_env()
    rank, watchdog = launch.rank, None
    try:  # the rendezvous too: a peer that never comes is a collective failure
        STARTUP.enable(rank == 0)
        if not STARTUP.stages:  # train.py marks its own: settings, training imports
            STARTUP.mark("imports and settings")
        rank, world, device = setup_distributed(launch, config.parallel.timeout_minutes,
                                                config.parallel.backend)
        STARTUP.mark("rendezvous")
        watchdog = Watchdog(rank, 0.9 * 60 * config.parallel.timeout_minutes).start()
        # A stop during the imports or the rendezvous ends here, before the model is built
        # (a launcher's grace period before its SIGKILL may be shorter than the build).
        if stop.agreed():
            if rank == 0:
                print(f"{stop.name or 'a signal to another rank'} during start-up: nothing "
                      "new to save; exiting", flush=True)
            return {"step": None, "last_saved": None, "last": {}, "stopped": True,
                    "save_dir": config.train.save_dir, "log_dir": config.train.log_dir}
        with save_dir_locked(config, launch):
            return _train(config, launch, world, device, stop, plan)
    except Exception as err:
        if is_collective_failure(err):
            said = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise TrainingError(
                f"{describe(rank)} when a collective failed: a peer rank died, froze or "
                "stopped on its own error (its line says which; parallel.timeout_minutes="
                f"{config.parallel.timeout_minutes}); torch said: {said}") from err
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()


def _train(config: Config, launch: LaunchEnv, world: int, device: torch.device,
           stop: StopFlag, plan: RunPlan | None) -> dict:
    from megatron_rembert.training.engine import Trainer

    rank = launch.rank
    POSITION.set(step=0, phase="start-up")
    plan, sha = check_inputs(config, world, device, rank, plan, launch)
    layout = plan.layout
    meta = run_meta(config, sha, plan)
    resume_folder, how = find_resume(config, meta, layout)
    STARTUP.mark("data checks")
    state.initialize_model_parallel(layout)
    log = MetricsLogger(config.train.log_dir, enabled=rank == 0, run_config=config.to_dict(),
                        wandb_project=config.train.wandb_project)
    trainer = Trainer(config, plan, device)  # marks "model"
    STARTUP.mark("engine")
    # Dropout streams seeded after the model is built: building draws from the default stream
    # (torch's own initialisation, overwritten by ours), as many numbers as the modules this
    # rank happens to hold. Resuming restores the saved streams.
    tp_random.seed_all(config.train.seed, device)
    POSITION.set(phase="resume")
    step, consumed = 0, 0
    if resume_folder is not None:
        resumed = ckpt.load_checkpoint(trainer.engine, resume_folder, how)
        step = resumed.step
        consumed = resume.data_position(resumed.consumed_samples,
                                        config.train.global_batch_size)
        log.console(f"resumed from {resume_folder.path} (step {step}, {consumed} samples "
                    "consumed)")
    STARTUP.mark("resume")
    train_cfg, data = config.train, config.data
    loader = build_pretraining_loader(data, layout, plan.data, seed=train_cfg.seed,
                                      tokenizer_sha256=sha, consumed_samples=consumed)
    STARTUP.mark("loader")
    POSITION.set(phase="signal agreement")
    if stop.agreed():  # a stop request during start-up: nothing new to save
        log.console(f"{stop.name or 'a signal to another rank'} during start-up: nothing new "
                    "to save; exiting")
        log.close()
        return {"step": step, "last_saved": step or None, "last": {}, "stopped": True,
                "save_dir": config.train.save_dir, "log_dir": config.train.log_dir}
    peak = peak_flops(device)
    average = RunAverage(layout.world_size, peak)
    divergence = DivergenceCheck(train_cfg.divergence_factor, train_cfg.divergence_window,
                                 train_cfg.max_nonfinite_steps, start_step=step)
    last_saved = step if step else None
    last = {}
    log.console(STARTUP.done())
    clock = StepClock(step, train_cfg.steps, started=PROCESS_START)
    while step < train_cfg.steps:
        start = time.perf_counter()
        POSITION.set(step=step + 1, phase="train step", detail="loading data")
        batches = [next(loader) for _ in range(layout.gas)]
        stats = trainer.train_step(batches)
        step += 1
        consumed += train_cfg.global_batch_size
        elapsed = time.perf_counter() - start
        # From the step's reduced statistics, alike on every rank: no collective here.
        diverged = divergence.problem(step, stats.loss, stats.grad_norm_finite, stats.skipped,
                                      last_step=step == train_cfg.steps)
        good = divergence.last_good == step
        tokens = train_cfg.global_batch_size * data.seq_length
        # Model FLOPs of this step (model/cost.py): the head's at its real masked tokens.
        flops = model_flops(config.model, data.seq_length, train_cfg.global_batch_size,
                            stats.masked_tokens)["training"]
        average.add(step, tokens, flops, elapsed)
        tokens_per_s = tokens / elapsed
        last = {"loss": stats.loss, "mlm_acc": stats.mlm_acc, "lr": stats.lr,
                "grad_norm": stats.grad_norm, "loss_scale": stats.loss_scale,
                "skipped": stats.skipped, "tokens_per_s": tokens_per_s,
                "masked_tokens": stats.masked_tokens, "consumed_samples": consumed,
                "memory": memory_gib(device), "flops": flops,
                # Model FLOP/s per process; MFU only on known GPUs.
                "tflops_per_gpu": flops / elapsed / layout.world_size / 1e12}
        if peak is not None:
            last["mfu"] = last["tflops_per_gpu"] * 1e12 / peak
        if step % train_cfg.log_interval == 0 or step == train_cfg.steps:
            log.log(step, last)
            log.console(format_line(step, train_cfg.steps, last, *clock.times(step),
                                    stop.deadline and stop.deadline - time.monotonic()))
        if diverged:
            ckpt.wait_for_save(trainer.engine)  # the last good checkpoint, before stopping
            log.close()
            raise DivergenceError(stop_message(step, diverged, train_cfg.save_dir))
        if train_cfg.eval_interval and step % train_cfg.eval_interval == 0:
            POSITION.set(phase="validation")
            evaluate(trainer, config, plan, sha, step, log)
        POSITION.set(phase="signal agreement")
        stopping = stop.agreed(time_limit=True)
        periodic = train_cfg.save_interval and step % train_cfg.save_interval == 0
        if (periodic or stopping or step == train_cfg.steps) and good:
            POSITION.set(phase="checkpoint save")
            ckpt.save_checkpoint(trainer.engine, train_cfg.save_dir, step, consumed, meta,
                                 train_cfg.keep_last, train_cfg.max_weight_abs,
                                 background=train_cfg.async_save)
            last_saved = step
        if stopping:
            POSITION.set(phase="checkpoint save")
            ckpt.wait_for_save(trainer.engine)  # a stop waits for the write
            kept = (f"saved step {step}" if last_saved == step else
                    f"{divergence.unsaved(step)}; last checkpoint: "
                    f"{f'step {last_saved}' if last_saved else 'none'}")
            why = (f"time limit reached (train.max_minutes={train_cfg.max_minutes:g})"
                   if stop.time_limit_reached and not stop.raised else
                   f"signal received ({stop.name or 'by another rank'})")
            log.console(f"{why}: {kept}, exiting for requeue")
            break
    POSITION.set(phase="checkpoint save")
    ckpt.wait_for_save(trainer.engine)  # the run's last save, complete before it says so
    trainer.wait_for_weights()  # the last step's, whether saved or not
    if average.values():
        log.log(step, average.values(), prefix="run_average")
    log.console(average.line())
    stop.settle()  # the run's last save is done: later stop signals change nothing
    log.close()
    return {"step": step, "last_saved": last_saved, "last": last, "stopped": stop.stopping,
            "time_limit_reached": stop.time_limit_reached, "average": average.values(),
            "save_dir": train_cfg.save_dir, "log_dir": train_cfg.log_dir}
