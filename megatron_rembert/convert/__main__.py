"""python -m megatron_rembert.convert {to-hf, from-hf, reshard, export-encoder, average} ...

See docs/convert.md. Every command writes into a temporary folder next to --out and renames it
at the end; a non-empty --out is refused unless --force.
"""

from __future__ import annotations

import argparse
import sys

from megatron_rembert.checkpoint import CheckpointError
from megatron_rembert.config import ConfigError
from megatron_rembert.convert.files import ConvertError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_rembert.convert",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("to-hf", help="checkpoint -> transformers RemBertForMaskedLM folder")
    p.add_argument("--checkpoint", required=True, help="a step_XXXXXXXX folder")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", help="SentencePiece .model (default: the one in meta.json)")
    p = sub.add_parser("export-encoder", help="checkpoint -> transformers RemBertModel folder "
                       "(no MLM head, no output embedding)")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer")
    p = sub.add_parser("from-hf", help="transformers RemBERT folder -> weights-only checkpoint")
    p.add_argument("--model", required=True, help="folder with config.json and weights")
    p.add_argument("--out", required=True, help="a train.save_dir to resume from")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--config", help="training YAML the model must agree with (optional)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--seed", type=int, help="seed for a missing MLM head (default train.seed)")
    p = sub.add_parser("reshard", help="checkpoint -> any TP x PP x DP, optimizer included")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True, help="a train.save_dir to resume from")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--weights-only", action="store_true", help="drop the optimizer state")
    p = sub.add_parser("average", help="the mean weights of several checkpoints -> a "
                       "weights-only checkpoint (fresh optimizer on resume)",
                       description="Write the mean of the checkpoints' fp32 weights as a "
                       "portable checkpoint (to-hf, export-encoder and training load it). "
                       "Weights only: the optimizer state is not averaged, so training "
                       "resumed from it starts a fresh optimizer and LR schedule at the "
                       "newest input's step and data position.")
    p.add_argument("--checkpoints", nargs="+", required=True, metavar="CHECKPOINT",
                   help="2 or more step_XXXXXXXX folders or save folders (their 'latest'), "
                   "any layouts, of one model")
    p.add_argument("--out", required=True, help="a train.save_dir; records the newest input's "
                   "step and consumed samples")
    for p in sub.choices.values():
        p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_rembert.convert import average, hf_io, reshard

    try:
        if args.command in ("to-hf", "export-encoder"):
            hf_io.export_hf(args.checkpoint, args.out, args.tokenizer, args.force,
                            encoder_only=args.command == "export-encoder")
        elif args.command == "from-hf":
            hf_io.import_hf(args.model, args.out, args.tp, args.pp, args.force, args.config,
                            args.set, args.seed)
        elif args.command == "average":
            average.average(args.checkpoints, args.out, args.force)
        else:
            reshard.reshard(args.checkpoint, args.out, args.tp, args.pp, args.force,
                            args.weights_only)
    except (ConvertError, ConfigError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
