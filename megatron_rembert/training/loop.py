"""The training loop: data, steps, metrics, validation, checkpoints, signals, resume."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rembert.checkpoint import CheckpointError, resume
from megatron_rembert.checkpoint.lock import SaveDirLock
from megatron_rembert.checkpoint.step_folder import (
    StepFolder,
    find_latest,
    roll_back,
    unexpected_entries,
)
from megatron_rembert.config import ConfigError, check_choice
from megatron_rembert.data.loader import build_pretraining_loader, build_validation_set
from megatron_rembert.data.shards import ShardDataset
from megatron_rembert.deepspeed_env import routine_lines_dropped, shm_op_build_note
from megatron_rembert.errors import RunError
from megatron_rembert.fs import sha256_file
from megatron_rembert.launch_env import launch_env
from megatron_rembert.model.cost import model_flops
from megatron_rembert.parallel import comm, state
from megatron_rembert.parallel import random as tp_random
from megatron_rembert.parallel.layout import Layout
from megatron_rembert.run_config import CHOICES, Config
from megatron_rembert.training import checkpoint as ckpt
from megatron_rembert.training.divergence import DivergenceCheck, DivergenceError, stop_message
from megatron_rembert.training.hang import POSITION, Watchdog, describe, is_collective_failure
from megatron_rembert.training.metrics import (
    MetricsLogger,
    RunAverage,
    StepClock,
    format_line,
    memory_gib,
    peak_flops,
)
from megatron_rembert.training.optim import lr_lambda
from megatron_rembert.training.plan import RunPlan
from megatron_rembert.training.signals import PROCESS_START, StopFlag
from megatron_rembert.training.startup import STARTUP


class TrainingError(RunError):
    """The run cannot go on (a peer died or froze, the losses stopped being finite): one
    `error:` line naming this rank's position, exit 1 (cli.run_cli)."""


def setup_distributed(timeout_minutes: float = 10.0, backend: str = "auto"
                      ) -> tuple[int, int, torch.device]:
    """Initialise torch.distributed from torchrun's environment (or a single process), with
    `timeout_minutes` for every process group, ours and DeepSpeed's; collectives run on the
    training device (parallel.comm). Ranks beyond the node's GPU count share GPUs, which only
    gloo allows (`backend`: auto = nccl on GPUs, gloo on CPUs)."""
    import deepspeed

    check_choice("parallel.backend", backend, CHOICES["parallel.backend"])  # before the plan
    cuda = torch.cuda.is_available()
    local_rank = launch_env().local_rank  # the launcher's variables, checked
    device = (torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda
              else torch.device("cpu"))
    if cuda:
        torch.cuda.set_device(device)
        # DeepSpeed takes LOCAL_RANK as the GPU index (engine, pipeline module): where ranks
        # share GPUs, it must name the GPU this rank uses.
        os.environ["LOCAL_RANK"] = str(device.index)
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    timeout = comm.set_default_timeout(timeout_minutes)
    if not dist.is_initialized():
        # Our own init, which DeepSpeed's then leaves alone: DeepSpeed binds every rank to
        # cuda:LOCAL_RANK, which does not exist where ranks share GPUs. NCCL ranks are bound
        # to their GPU (eager communicator setup); gloo ranks to none.
        world = int(os.environ["WORLD_SIZE"])
        bind = cuda and backend == "nccl" and world > 1
        dist.init_process_group(backend, timeout=timeout, rank=int(os.environ["RANK"]),
                                world_size=world, device_id=device if bind else None)
    if device.type == "cpu" and dist.get_rank() == 0 and (note := shm_op_build_note()):
        print(note, flush=True)
    with routine_lines_dropped():  # DeepSpeed's "built successfully" line, every start
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    comm.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def check_inputs(config: Config, world_size: int, device: torch.device, rank: int = 0,
                 plan: RunPlan | None = None) -> tuple[RunPlan, str | None]:
    """Every cheap check before heavy work: the run plan (config, layout, stage split), data
    folder, tokenizer, vocabulary (the one place the model's vocabulary is compared with the
    dataset's). Returns this rank's run plan (`plan` as given, else built here once) and the
    tokenizer's sha256."""
    if plan is None:
        plan = RunPlan.build(config, world_size, rank)
    elif (plan.layout.world_size, plan.layout.rank) != (world_size, rank):
        raise RuntimeError(f"the run plan is of rank {plan.layout.rank} of "
                           f"{plan.layout.world_size}, this process is rank {rank} of "
                           f"{world_size}")
    if plan.layout.pp > 1:
        if device.type == "cuda" and config.parallel.backend == "gloo":
            raise ConfigError("parallel.backend=gloo with parallel.pp>1 on GPUs: gloo's "
                              "send/recv between pipeline stages take CPU tensors only (a "
                              "CUDA tensor aborts the process); use parallel.backend=nccl "
                              "(auto), one rank per GPU")
    if config.train.precision == "fp16" and device.type != "cuda":
        from deepspeed.accelerator import get_accelerator

        if not get_accelerator().is_fp16_supported():
            raise ConfigError("train.precision=fp16 needs a GPU: DeepSpeed allows fp16 on a CPU "
                              "only with oneDNN fp16 support, which this CPU lacks; use bf16 "
                              "or fp32")
    data = config.data
    if not data.path:
        raise ConfigError("data.path is not set: point it at a folder made by "
                          "data_tools/preprocess.py (--set data.path=DIR)")
    if not Path(data.path, "manifest.json").is_file():
        raise ConfigError(f"data.path={data.path}: no manifest.json there; make the dataset "
                          "with data_tools/preprocess.py")
    sha = None
    if data.tokenizer:
        if not Path(data.tokenizer).is_file():
            raise ConfigError(f"data.tokenizer={data.tokenizer}: no such file")
        sha = sha256_file(data.tokenizer)
    # Starts hashing the shards in a background thread while the model is built (the loader
    # waits for the checks of the shards each batch reads).
    dataset = ShardDataset(data.path, "train", tokenizer_sha256=sha, seq_length=data.seq_length,
                           verify_in_background=True)
    if data.whole_word_mask:
        dataset.word_starts()  # read (and checked) now, not after the model is built
    unknown = sorted(set(data.language_start) - set(dataset.languages))
    if unknown:
        raise ConfigError(f"data.language_start names {unknown}, which data.path={data.path} "
                          f"does not have (its languages: {', '.join(dataset.languages)})")
    if data.language_start and all(data.language_start.get(lang, 0.0) > 0
                                   for lang in dataset.languages
                                   if dataset.rows_per_language[lang]):
        raise ConfigError("data.language_start: every language enters late; at least one "
                          "must be sampled from the start (leave it out, or give 0.0)")
    larger = data.allow_larger_vocab and dataset.vocab_size < config.model.vocab_size
    if dataset.vocab_size != config.model.vocab_size and not larger:
        hint = (" (data.allow_larger_vocab=true accepts a model vocabulary larger than the "
                "dataset's)" if dataset.vocab_size < config.model.vocab_size else "")
        raise ConfigError(
            f"data.path={data.path} was made with a tokenizer of {dataset.vocab_size} pieces, "
            f"model.vocab_size={config.model.vocab_size}; set model.vocab_size="
            f"{dataset.vocab_size} or use the matching dataset{hint}")
    return plan, sha


def _meta(config: Config, sha: str | None, plan: RunPlan) -> dict:
    """What every checkpoint of this run records beside its step. `config`: the settings as
    given (parallel.* included, to reproduce the run); `layout` and `stage_boundaries`: what
    the run resolved them to (how the files are cut: what a resume and the readers compare)."""
    return {"config": config.to_dict(), "tokenizer_sha256": sha,
            "dataset_sha256": sha256_file(Path(config.data.path, "manifest.json")),
            "layout": plan.layout.sizes(), "stage_boundaries": plan.stage_boundaries}


@contextmanager
def _save_dir_locked(config: Config) -> Iterator[None]:
    """Rank 0 locks train.save_dir (which also proves it writable) before any heavy work;
    every rank learns whether that worked."""
    lock = SaveDirLock(config.train.save_dir)
    with comm.agree_or_raise(CheckpointError, lambda error, ranks: error or CheckpointError(
            f"train.save_dir={config.train.save_dir}: rank 0 could not lock it (its error says "
            "why)")):
        if comm.rank() == 0:
            lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _find_resume(config: Config, meta_now: dict, layout: Layout
                 ) -> tuple[StepFolder | None, str]:
    """The checkpoint to resume from (after a roll-back to train.resume_from) and how it loads
    at this run's layout (checkpoint.resume.check_resume), checked before the model is built."""
    save_dir = Path(config.train.save_dir)
    if config.train.resume_from:
        if comm.rank() == 0:
            moved = roll_back(save_dir, Path(config.train.resume_from))
            if moved is None:
                print(f"train.resume_from={config.train.resume_from}: rolled back before; "
                      "resuming from 'latest'", flush=True)
            elif moved:
                print(f"rolled back to {config.train.resume_from}: moved "
                      f"{', '.join(p.name for p in moved)} into {moved[0].parent}", flush=True)
        comm.barrier()
    if comm.rank() == 0 and (stray := unexpected_entries(save_dir)):
        print(f"{save_dir}: ignored, not checkpoints of this run: {', '.join(stray)}",
              flush=True)  # once, at start-up; saving and pruning leave them alone
    latest = find_latest(save_dir)
    if latest is None:
        return None, "same"
    how, notices = resume.check_resume(latest, config, meta_now, layout, lr_lambda)
    if comm.rank() == 0:  # another global batch size, LR schedule or stage split: said once
        for notice in notices:
            print(notice, flush=True)
    return latest, how


def train(config: Config, stop: StopFlag | None = None, plan: RunPlan | None = None) -> dict:
    """Run (or resume) training; returns a summary of where everything went.

    `stop`: the stop-signal flag (training/signals.py), installed here if not given; train.py
    installs it before its heavy imports. `plan`: this rank's run plan, when the caller
    resolved it already (train.py does, for its memory check); built here otherwise.

    A collective that times out or breaks (a peer hung, died or stopped on its own error)
    ends the run with one line naming this rank's position (step, phase, micro-batch or
    pipeline instruction) and what torch said, on every rank that saw it.
    """
    stop = stop or StopFlag()
    stop.set_time_limit(config.train.max_minutes)
    rank, watchdog = launch_env().rank, None
    try:  # the rendezvous too: a peer that never comes is a collective failure
        STARTUP.enable(rank == 0)
        STARTUP.mark("imports and settings")
        rank, world, device = setup_distributed(config.parallel.timeout_minutes,
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
        with _save_dir_locked(config):
            return _train(config, rank, world, device, stop, plan)
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


def _train(config: Config, rank: int, world: int, device: torch.device, stop: StopFlag,
           plan: RunPlan | None) -> dict:
    from megatron_rembert.training.engine import Trainer

    POSITION.set(step=0, phase="start-up")
    plan, sha = check_inputs(config, world, device, rank, plan)
    layout = plan.layout
    meta = _meta(config, sha, plan)
    resume_folder, how = _find_resume(config, meta, layout)
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
                                 train_cfg.keep_last, train_cfg.max_weight_abs)
            last_saved = step
        if stopping:
            kept = (f"saved step {step}" if last_saved == step else
                    f"{divergence.unsaved(step)}; last checkpoint: "
                    f"{f'step {last_saved}' if last_saved else 'none'}")
            why = (f"time limit reached (train.max_minutes={train_cfg.max_minutes:g})"
                   if stop.time_limit_reached and not stop.raised else
                   f"signal received ({stop.name or 'by another rank'})")
            log.console(f"{why}: {kept}, exiting for requeue")
            break
    if average.values():
        log.log(step, average.values(), prefix="run_average")
    log.console(average.line())
    stop.settle()  # the run's last save is done: later stop signals change nothing
    log.close()
    return {"step": step, "last_saved": last_saved, "last": last, "stopped": stop.stopping,
            "time_limit_reached": stop.time_limit_reached, "average": average.values(),
            "save_dir": train_cfg.save_dir, "log_dir": train_cfg.log_dir}


def evaluate(trainer, config: Config, plan: RunPlan, sha: str | None, step: int,
             log: MetricsLogger) -> None:
    """Loss and accuracy on the fixed validation set, per language and overall: token-weighted
    (all masked tokens together) and language-averaged (the mean of the languages' numbers).
    Each language is evaluated in whole global batches (padding rows carry no weight). With
    eval.retrieval_path, each language's retrieval accuracy@1 to and from English joins its
    numbers in the same row (training/retrieval.py)."""
    from megatron_rembert.training.retrieval import add_retrieval, pooled_layer, retrieval_accuracy

    layout = plan.layout
    per_language = min(config.eval.sequences_per_language,
                       config.train.eval_batches * layout.global_batch_size)
    valid = build_validation_set(config.data, layout, plan.data, seed=config.train.seed,
                                 per_language=per_language, tokenizer_sha256=sha)
    languages = {}
    for index, lang in enumerate(valid.languages):
        batches = valid.batches(index)
        if not batches:
            continue
        loss, acc, tokens = trainer.eval_step(batches)
        languages[lang] = {"loss": loss, "mlm_acc": acc, "masked_tokens": tokens}
    retrieval = {}
    if config.eval.retrieval_path:
        POSITION.set(phase="retrieval")
        retrieval = retrieval_accuracy(trainer, config)
    if not languages and not retrieval:
        log.console("validation split is empty: nothing to evaluate")
        return
    overall = combine_languages(languages) if languages else {}
    if retrieval:
        add_retrieval(overall, retrieval)
    log.log(step, overall, prefix="valid")
    if languages:
        log.console(f"step {step:>7} | validation loss {overall['loss']:.4f} | acc "
                    f"{overall['mlm_acc']:.3f} | language average loss "
                    f"{overall['loss_lang_avg']:.4f} acc {overall['mlm_acc_lang_avg']:.3f}")
    if retrieval:
        log.console(f"step {step:>7} | retrieval acc@1 to en {overall['retrieval_to_en']:.3f}"
                    f" from en {overall['retrieval_from_en']:.3f} (chance "
                    f"{overall['retrieval_chance']:.3f}; {len(retrieval)} languages, layer "
                    f"{pooled_layer(config)})")


def combine_languages(languages: dict[str, dict]) -> dict:
    """Overall validation numbers from the per-language ones (kept under "languages")."""
    tokens = sum(v["masked_tokens"] for v in languages.values())
    n = len(languages)
    return {
        "loss": sum(v["loss"] * v["masked_tokens"] for v in languages.values()) / max(tokens, 1),
        "mlm_acc": sum(v["mlm_acc"] * v["masked_tokens"]
                       for v in languages.values()) / max(tokens, 1),
        "masked_tokens": tokens,
        "loss_lang_avg": sum(v["loss"] for v in languages.values()) / n,
        "mlm_acc_lang_avg": sum(v["mlm_acc"] for v in languages.values()) / n,
        "languages": languages,
    }
