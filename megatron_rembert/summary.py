"""Model sizes and FLOPs (the cost model, model/cost.py): `python -m megatron_rembert.summary
--preset rembert`.

Builds the model on the meta device, so even the 995M model allocates nothing.
"""

from __future__ import annotations

import argparse
import sys

from megatron_rembert.cli import prog, run_cli
from megatron_rembert.config import PRESETS, get_preset
from megatron_rembert.data.config import DataConfig
from megatron_rembert.model.cost import flops_per_token
from megatron_rembert.model.sizes import parameter_counts


def format_summary(name: str, seq_length: int, mask_rate: float) -> str:
    config = get_preset(name)
    counts = parameter_counts(config)
    flops = flops_per_token(config, seq_length, mask_rate)
    pt = counts.pretraining_with_pooler
    rows = [
        ("pre-training parameters (with pooler)", f"{counts.pretraining_with_pooler:,}"),
        ("pre-training parameters (no pooler)", f"{counts.pretraining:,}"),
        ("fine-tuning parameters (encoder, no pooler)", f"{counts.finetuning:,}"),
        ("fine-tuning parameters (encoder + pooler)", f"{counts.finetuning_with_pooler:,}"),
        ("input embedding |V| x E_in", f"{counts.input_embedding:,}"),
        ("output embedding |V| x E_out + bias", f"{counts.output_embedding:,}"),
        ("input embedding share of pre-training", f"{counts.input_embedding / pt:.1%}"),
        ("output embedding share of pre-training", f"{counts.output_embedding / pt:.1%}"),
        ("input embedding share of fine-tuning",
         f"{counts.input_embedding / counts.finetuning:.1%}"),
        (f"forward FLOPs/token (seq {seq_length}, mask {mask_rate:.0%})",
         f"{flops['forward']:,.0f}"),
        ("training FLOPs/token (3x forward)", f"{flops['training']:,.0f}"),
        ("MLM head share of forward FLOPs", f"{flops['head_share']:.1%}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"preset {name}: E_in={config.input_embedding_size} "
             f"E_out={config.output_embedding_size} H={config.hidden_size} "
             f"L={config.num_hidden_layers} V={config.vocab_size:,} tied={config.tie_embeddings}"]
    lines += [f"  {k:<{width}}  {v:>15}" for k, v in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog("python -m megatron_rembert.summary"),
        description="Exact parameter counts, embedding shares and FLOPs per token of a preset.")
    parser.add_argument("--preset", default="rembert", choices=sorted(PRESETS) + ["all"],
                        help="model preset (default: rembert); 'all' prints every preset")
    parser.add_argument("--seq-length", type=int, default=DataConfig.seq_length,
                        help=f"tokens per sequence (default {DataConfig.seq_length})")
    parser.add_argument("--mask-rate", type=float, default=DataConfig.mask_prob,
                        help="fraction of tokens with an MLM prediction (head FLOPs; "
                        f"default {DataConfig.mask_prob})")
    args = parser.parse_args(argv)
    names = sorted(PRESETS) if args.preset == "all" else [args.preset]
    print("\n\n".join(format_summary(n, args.seq_length, args.mask_rate) for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
