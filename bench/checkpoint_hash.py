"""What the checkpoint manifest costs: the trainer's save with and without sha256 hashing.

One process (gloo), a scaled RemBERT (default 24M parameters, fp32, ZeRO-1: about 190 MiB per
checkpoint; --hidden/--layers/--vocab scale it), saved into a temporary folder:
  plain   the same optimizer shard written by safetensors' own `save_file` + the RNG file:
          the bytes of a save, nothing hashed, fsynced or committed
  synced  plain, then every file fsynced: what durability alone costs
  hashed  training/checkpoint.save_checkpoint: every file fsynced and hashed right after it
          is written (from the page cache, by the rank that wrote it), the manifest,
          `complete` and `latest` committed, the finite-weights check
  sha256  hashing the same bytes alone, from memory: the part of `hashed` that is hashing
Each save is run --reps times, in rotating order (nothing pruned, so none pays for deleting
an older folder); the fastest of each is compared, and the ratios hashed / plain, hashed /
synced and sha256 / plain are printed last. Writes land in the page cache here, far faster
than on a cluster file system, so the ratios are upper bounds of what hashing adds there.

    python -m bench.checkpoint_hash [--hidden 512] [--layers 4] [--vocab 30000] [--reps 3]
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench.common import CHECKPOINT_TINY_ARGS, checkpoint_meta, checkpoint_parser
from megatron_rembert.train import end_process_groups, exit_now

TINY_ARGS = CHECKPOINT_TINY_ARGS


def main(argv: list[str] | None = None) -> None:
    parser = checkpoint_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)

    import torch
    from safetensors.torch import save_file

    from bench.common import checkpoint_trainer
    from megatron_rembert.checkpoint import optimizer_shards
    from megatron_rembert.checkpoint.specs import ParamSpec
    from megatron_rembert.checkpoint.step_folder import step_tag
    from megatron_rembert.parallel import random as tp_random
    from megatron_rembert.training import checkpoint as ckpt

    trainer, config = checkpoint_trainer(args.hidden, args.layers, args.vocab, port=29533)
    engine = trainer.engine
    params = sum(p.numel() for p in engine.module.parameters())
    meta = checkpoint_meta(config)
    root = Path(args.dir or tempfile.mkdtemp(prefix="checkpoint_hash."))

    specs = {id(p): ParamSpec.of(n, p, config.model.num_hidden_layers)
             for n, p in engine.module.named_parameters()}
    trainer.wait_for_weights()

    def plain(i: int) -> None:
        folder = root / "plain" / f"step_{i:08d}"
        (folder / "rng").mkdir(parents=True, exist_ok=True)
        shard = optimizer_shards.collect(engine.optimizer, specs)
        save_file({k: t.contiguous() for k, t in shard.items}, folder / shard.name,
                  metadata=shard.meta)
        torch.save(tp_random.get_rng_states(), folder / "rng" / "rank_00000.pt")

    def synced(i: int) -> None:
        plain(i)
        for f in (root / "plain" / f"step_{i:08d}").rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)

    def hashed(i: int) -> None:
        ckpt.save_checkpoint(engine, root / "hashed", i, 0, meta, keep_last=args.reps)

    times: dict[str, list[float]] = {"plain": [], "synced": [], "hashed": []}
    try:
        for i in range(1, args.reps + 1):
            order = (("plain", plain), ("synced", synced), ("hashed", hashed))
            for name, save in order if i % 2 else order[::-1]:
                shutil.rmtree(root / "plain", ignore_errors=True)
                start = time.perf_counter()
                save(i)
                times[name].append(time.perf_counter() - start)
        files = [f for f in (root / "hashed" / step_tag(args.reps)).rglob("*")
                 if f.is_file()]
        size = sum(f.stat().st_size for f in files)
        blobs = [f.read_bytes() for f in files]
        for _ in range(args.reps):
            start = time.perf_counter()
            for blob in blobs:
                hashlib.sha256(blob).hexdigest()
            times.setdefault("sha256", []).append(time.perf_counter() - start)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    best = {k: min(v) for k, v in times.items()}
    print(f"{params / 1e6:.1f}M parameters, {size / 2**20:.0f} MiB per checkpoint, "
          f"best of {args.reps}")
    for name, seconds in best.items():
        print(f"  {name:7s} {seconds:6.2f} s  ({size / 2**20 / seconds:6.0f} MiB/s)")
    print(f"hashed / plain: {best['hashed'] / best['plain']:.2f}; hashed / synced: "
          f"{best['hashed'] / best['synced']:.2f}; sha256 / plain: "
          f"{best['sha256'] / best['plain']:.2f}")


if __name__ == "__main__":
    main()
    end_process_groups()
    exit_now(0)  # as train.py ends: not through the interpreter's teardown of gloo
