"""rembert-eval: how good is an encoder, per language (docs/eval.md).

Parse, check every input (flags, the sets, the model's config and tokenizer, --out's folder)
and only then load the model, evaluate and report. Bad input is one `error:` line naming the
flag, file, line or field, exit 2, before any weight is loaded.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_rembert.cli import prog, run_cli
from megatron_rembert.errors import UserError

DESCRIPTION = (
    "Evaluate a pre-trained encoder per language: retrieval between each language and "
    "English (accuracy@1 both ways, mean-pooled layer, cosine) and zero-shot classification "
    "(fine-tuned on one language, tested on all), each beside the same architecture at "
    "step 0, a bag-of-tokens baseline and chance. Formats, figures and the JSON schema: "
    "docs/eval.md.")


class EvalUsageError(UserError):
    """A flag with a value the evaluation cannot use."""


def build_parser() -> argparse.ArgumentParser:
    from megatron_rembert.eval.settings import BASELINES, Settings

    d = Settings(layers=[], layer=0)
    p = argparse.ArgumentParser(prog=prog("python -m megatron_rembert.eval"),
                                description=DESCRIPTION)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a training checkpoint: a step_XXXXXXXX folder or a "
                     "save folder (its 'latest'), any tp/pp/dp layout and precision")
    src.add_argument("--hf", help="a transformers folder written by rembert-convert to-hf or "
                     "export-encoder (config.json, model.safetensors)")
    p.add_argument("--tokenizer", help="SentencePiece .model (default: the checkpoint's "
                   "data.tokenizer, checked against its recorded sha256; the --hf folder's "
                   "sentencepiece.model)")
    p.add_argument("--parallel", metavar="DIR", help="retrieval sets: <lang>.jsonl "
                   '({"id", "text", "en"} per line) or <lang>.tsv (text<TAB>en) files')
    p.add_argument("--classify-train", metavar="FILE", help='classification examples, '
                   '{"id", "lang", "label", "text"} per line; only --train-lang is used')
    p.add_argument("--classify-test", metavar="FILE", help="classification test examples, "
                   "every language evaluated")
    p.add_argument("--train-lang", default=d.train_lang, help="the fine-tuning language "
                   f"(default {d.train_lang})")
    p.add_argument("--layer", default=None, help="retrieval layer: 0 = embeddings .. "
                   "num_hidden_layers, or 'all' (default: the middle one, "
                   "(num_hidden_layers + 1) // 2, as the trainer's eval.retrieval_layer)")
    p.add_argument("--max-length", type=int, default=d.max_length,
                   help=f"tokens per text, [CLS] and [SEP] included (default {d.max_length})")
    p.add_argument("--max-pairs", type=int, default=d.max_pairs, help="pairs per language: "
                   "a fixed subset of larger sets, the one the trainer's eval.retrieval_pairs "
                   f"picks (default {d.max_pairs})")
    p.add_argument("--seeds", type=int, default=d.seeds,
                   help=f"fine-tuning runs per system (default {d.seeds})")
    p.add_argument("--epochs", type=int, default=d.epochs, help=f"default {d.epochs}")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"fine-tuning batch size (default {d.batch_size})")
    p.add_argument("--encode-batch-size", type=int, default=d.encode_batch_size,
                   help=f"texts per forward pass when embedding (default {d.encode_batch_size})")
    p.add_argument("--skip-retrieval", action="store_true")
    p.add_argument("--skip-classify", action="store_true")
    p.add_argument("--baselines", default=",".join(BASELINES), help="comma-separated subset "
                   f"of {','.join(BASELINES)}, or none (default all)")
    p.add_argument("--bag-weighting", choices=("counts", "tfidf"), default=d.bag_weighting,
                   help=f"bag-of-tokens retrieval vectors (default {d.bag_weighting})")
    p.add_argument("--center", action="store_true",
                   help="retrieval: subtract each language's mean vector from its texts' "
                   "vectors before the cosine (models and bag alike; Libovicky et al., 2020); "
                   "XTREME does not (default off)")
    p.add_argument("--init-seed", type=int, help="seed of the step-0 model (default: the "
                   "checkpoint's train.seed; 1234, the trainer's default, for --hf)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--out", help="write every figure as JSON here (docs/eval.md)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def _check_flags(args) -> tuple[str, ...]:
    from megatron_rembert.eval.settings import BASELINES

    for flag, value, low in (("--max-length", args.max_length, 3), ("--max-pairs",
                             args.max_pairs, 1), ("--seeds", args.seeds, 1),
                             ("--epochs", args.epochs, 1), ("--batch-size", args.batch_size, 1),
                             ("--encode-batch-size", args.encode_batch_size, 1)):
        if value < low:
            raise EvalUsageError(f"{flag} {value}: must be >= {low}")
    if not args.lr > 0:
        raise EvalUsageError(f"--lr {args.lr}: must be > 0")
    chosen = tuple(b for b in args.baselines.split(",") if b and b != "none")
    unknown = [b for b in chosen if b not in BASELINES]
    if unknown:
        raise EvalUsageError(f"--baselines {args.baselines}: unknown {unknown}; choose from "
                             f"{','.join(BASELINES)} or none")
    if bool(args.classify_train) != bool(args.classify_test):
        raise EvalUsageError("--classify-train and --classify-test go together")
    retrieval = args.parallel and not args.skip_retrieval
    classify = args.classify_train and not args.skip_classify
    if not retrieval and not classify:
        raise EvalUsageError("nothing to evaluate: give --parallel DIR and/or "
                             "--classify-train FILE --classify-test FILE (not skipped)")
    if not (args.device == "cpu" or args.device == "cuda" or args.device.startswith("cuda:")):
        raise EvalUsageError(f"--device {args.device}: expected cpu, cuda or cuda:N")
    if args.out:
        from megatron_rembert.fs import unwritable_reason

        if os.path.isdir(args.out):
            raise EvalUsageError(f"--out {args.out}: is a folder; name a .json file")
        if reason := unwritable_reason(os.path.dirname(os.path.abspath(args.out))):
            raise EvalUsageError(f"--out {args.out}: {reason}")
    return chosen


def _layers(value: str | None, num_layers: int) -> tuple[list[int], int]:
    from megatron_rembert.model.retrieval import middle_layer

    middle = middle_layer(num_layers)
    if value is None:
        return [middle], middle
    if value == "all":
        return list(range(num_layers + 1)), middle
    try:
        layer = int(value)
    except ValueError:
        layer = -1
    if not 0 <= layer <= num_layers:
        raise EvalUsageError(f"--layer {value}: expected 0 (embeddings) .. {num_layers} "
                             "(the model's num_hidden_layers) or all")
    return [layer], layer


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    baselines = _check_flags(args)
    from megatron_rembert.deepspeed_env import choose_accelerator

    choose_accelerator()  # before DeepSpeed's import (checkpoint files): no accelerator warning
    from megatron_rembert.data.parallel_text import read_parallel_set
    from megatron_rembert.eval import data, report, suite
    from megatron_rembert.eval.encoder import open_checkpoint, open_hf
    from megatron_rembert.eval.progress import Progress

    parallel = (read_parallel_set(args.parallel, args.max_pairs, f"--parallel {args.parallel}")
                if args.parallel and not args.skip_retrieval else None)
    train = test = None
    if args.classify_train and not args.skip_classify:
        train = data.read_classification(args.classify_train, "--classify-train")
        test = data.read_classification(args.classify_test, "--classify-test")
    source = (open_checkpoint(args.checkpoint, args.tokenizer) if args.checkpoint
              else open_hf(args.hf, args.tokenizer))
    if args.max_length > source.config.max_position_embeddings:
        raise EvalUsageError(f"--max-length {args.max_length}: the model has "
                             f"{source.config.max_position_embeddings} positions "
                             "(max_position_embeddings)")
    if args.device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise EvalUsageError(f"--device {args.device}: CUDA is not available here")
    layers, layer = _layers(args.layer, source.config.num_hidden_layers)
    settings = suite.Settings(
        layers=layers, layer=layer, max_length=args.max_length, max_pairs=args.max_pairs,
        seeds=args.seeds, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
        encode_batch_size=args.encode_batch_size, train_lang=args.train_lang,
        baselines=baselines, bag_weighting=args.bag_weighting, center=args.center,
        device=args.device, init_seed=args.init_seed)
    prepared = suite.prepare(source.tokenizer, settings, parallel, train, test)
    progress = Progress(1, enabled=not args.quiet)
    try:
        results = suite.run(source, prepared, settings, progress)
    finally:
        progress.close()
    doc = report.document(source, settings, results)
    print(report.console(doc, settings))
    if args.out:
        report.write_json(args.out, doc)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
