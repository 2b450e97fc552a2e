"""python -m megatron_rembert.convert {to-hf, from-hf, reshard, export-encoder, average} ...

See docs/convert.md. Every command writes into a temporary folder next to --out and renames it
at the end; a non-empty --out is refused unless --force. Before anything is written, every
stored tensor is checked against the model (convert/tensor_check.py) and --out is kept apart
from every input (convert/files.py: check_out_apart).
"""

from __future__ import annotations

import argparse
import sys

from megatron_rembert.cli import prog, run_cli

DESCRIPTION = ("Convert checkpoints to and from transformers RemBERT folders, and between "
               "TP x PP layouts. Every command writes into a temporary folder next to --out "
               "and renames it at the end; a non-empty --out is refused unless --force. "
               "Before anything is written, every tensor read is checked against the model "
               "(name, shape, dtype) and --out may not be, hold or lie inside an input, "
               "--force or not. See docs/convert.md.")
CHECKPOINT_HELP = ("a step_XXXXXXXX folder, or a save folder (train.save_dir, or the --out of "
                   "from-hf/reshard): the checkpoint its 'latest' names")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog("python -m megatron_rembert.convert"),
                                     description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text + ".")

    for name, text in (
            ("to-hf", "checkpoint -> transformers RemBertForMaskedLM folder (weights, "
                      "config.json, tokenizer files)"),
            ("export-encoder", "checkpoint -> transformers RemBertModel folder (the encoder "
                               "for fine-tuning: no MLM head, no output embedding)")):
        p = command(name, text)
        p.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
        p.add_argument("--out", required=True, help="the folder to write")
        p.add_argument("--tokenizer", help="SentencePiece .model (default: data.tokenizer "
                       "recorded in the checkpoint's meta.json)")
    p = command("from-hf", "transformers RemBERT folder -> weights-only checkpoint to start "
                "training from (step 0)")
    p.add_argument("--model", required=True, help="folder with config.json and "
                   "model.safetensors (or pytorch_model.bin)")
    p.add_argument("--out", required=True, help="a train.save_dir to resume from")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size to check the model "
                   "against (default 1; the trainer loads any layout)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to check the model "
                   "against (default 1)")
    p.add_argument("--config", help="training YAML the model must agree with (optional)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of --config, as train.py --set (repeatable)")
    p.add_argument("--seed", type=int, help="seed for a missing MLM head (default train.seed)")
    p = command("reshard", "checkpoint -> another TP x PP (any DP), optimizer state included")
    p.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
    p.add_argument("--out", required=True, help="a train.save_dir to resume from")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: the checkpoint's)")
    p.add_argument("--pp", type=int, help="pipeline-parallel size (default: the checkpoint's)")
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
    """Bad input (a ConvertError, ConfigError or CheckpointError): one `error:` line, exit 2."""
    return run_cli(_main, argv)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_rembert.deepspeed_env import choose_accelerator

    choose_accelerator()  # before DeepSpeed's import (checkpoint files): no accelerator warning
    from megatron_rembert.convert import average, hf_io, reshard

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
