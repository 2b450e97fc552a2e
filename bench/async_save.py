"""What a background save (train.async_save) blocks the training step for, against the same
save in the foreground.

One process (gloo), the scaled RemBERT of bench/checkpoint_hash.py (fp32, ZeRO-1; --hidden,
--layers, --vocab scale it), saved with training/checkpoint.save_checkpoint:
  foreground  the whole save: DeepSpeed's states collected, every file written, fsynced and
              hashed, the manifest, `complete` and `latest`
  blocking    the same save with background=True, until it returns: what the step waits for
              (the states copied off the training buffers)
  background  from there until its wait() returns: what the step no longer waits for (the
              weights check on the copy, the writes, hashes, manifest and `latest`)
Each is run --reps times in rotating order; the fastest of each is compared, and the ratio
blocking / foreground is printed last (the issue's bound: 0.25).

    python -m bench.async_save [--hidden 512] [--layers 4] [--vocab 30000] [--reps 3]
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from bench.common import CHECKPOINT_TINY_ARGS, checkpoint_meta, checkpoint_parser, write_json
from megatron_rembert.train import end_process_groups, exit_now

TINY_ARGS = CHECKPOINT_TINY_ARGS


def main(argv: list[str] | None = None) -> None:
    parser = checkpoint_parser(__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)

    from bench.common import checkpoint_trainer
    from megatron_rembert.training import checkpoint as ckpt

    trainer, config = checkpoint_trainer(args.hidden, args.layers, args.vocab, port=29534)
    engine = trainer.engine
    params = sum(p.numel() for p in engine.module.parameters())
    meta = checkpoint_meta(config)
    root = Path(args.dir or tempfile.mkdtemp(prefix="async_save."))
    times: dict[str, list[float]] = {"foreground": [], "blocking": [], "background": []}
    step = 0
    try:
        for rep in range(args.reps):
            for background in ((False, True) if rep % 2 == 0 else (True, False)):
                step += 1
                start = time.perf_counter()
                saved = ckpt.save_checkpoint(engine, root / "saves", step, 0, meta, keep_last=1,
                                             background=background)
                returned = time.perf_counter()
                if background:
                    saved.wait()
                    times["blocking"].append(returned - start)
                    times["background"].append(time.perf_counter() - returned)
                else:
                    times["foreground"].append(returned - start)
        size = sum(f.stat().st_size for f in (root / "saves").rglob("*") if f.is_file())
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    best = {k: min(v) for k, v in times.items()}
    ratio = best["blocking"] / best["foreground"]
    print(f"{params / 1e6:.1f}M parameters, {size / 2**20:.0f} MiB per checkpoint, "
          f"best of {args.reps}")
    for name, seconds in best.items():
        print(f"  {name:10s} {seconds:6.2f} s")
    print(f"blocking / foreground: {ratio:.2f}")
    if args.json:
        write_json(args.json, {"parameters": params, "checkpoint_bytes": size,
                               "seconds": best, "blocking_over_foreground": ratio})


if __name__ == "__main__":
    main()
    end_process_groups()
    exit_now(0)  # as train.py ends: not through the interpreter's teardown of gloo
