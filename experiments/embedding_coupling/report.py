"""The table and plot of the embedding-coupling experiment, from its committed result files.

    python -m experiments.embedding_coupling.report [--scale cpu] [--tag sweep] [--plot FILE]

Prints a Markdown table (one row per variant: mean and spread over pre-training seeds, then the
step-0, bag-of-tokens and chance rows) for docs/experiments.md, and with --plot draws the
validation curves and the transfer figures (matplotlib, `pip install -e '.[plot]'`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from experiments.embedding_coupling.variants import VARIANTS

HERE = Path(__file__).resolve().parent


def load(scale: str, tag: str) -> dict[str, list[dict]]:
    """Result files of one scale and tag, by variant in VARIANTS' order."""
    runs: dict[str, list[dict]] = {}
    for path in sorted((HERE / "results" / scale / tag).glob("*.json")):
        result = json.loads(path.read_text())
        runs.setdefault(result["variant"], []).append(result)
    return {v: sorted(runs[v], key=lambda r: r["seed"]) for v in VARIANTS if v in runs}


def both_ways(entry: dict) -> float:
    """Retrieval accuracy@1, the mean of the two directions."""
    return (entry["to_en"] + entry["from_en"]) / 2


def figures(result: dict, encoder: str = "model") -> dict[str, float | None]:
    """The numbers of one run's table row (encoder: "model" or "step0")."""
    ev, valid = result["eval"], result["metrics"]["valid"] or {}
    retrieval = ev.get("retrieval", {})
    per_layer = retrieval.get("per_layer", {}).get(encoder, [])
    best = max((both_ways(x["average"]) for x in per_layer), default=None)
    transfer = ev.get("classification", {}).get("average_transfer", {}).get(encoder, {})
    centered = result.get("eval_centered", {}).get("retrieval", {})
    return {
        "retrieval": both_ways(retrieval["average"][encoder]) if retrieval else None,
        "retrieval_centered": both_ways(centered["average"][encoder]) if centered else None,
        "retrieval_best_layer": best,
        "zero_shot": transfer.get("mean"),
        "zero_shot_seed_std": transfer.get("std"),
        # mean recall over the labels: chance is 1/K whatever the labels' shares
        "zero_shot_balanced": transfer.get("balanced", {}).get("mean"),
        "valid_loss": valid.get("loss") if encoder == "model" else None,
        "valid_loss_lang_avg": valid.get("loss_lang_avg") if encoder == "model" else None,
    }


def spread(values: list[float | None]) -> str:
    """mean ± sample standard deviation over seeds (just the mean for one seed)."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = statistics.fmean(values)
    return (f"{mean:.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1
            else f"{mean:.3f}")


def table(runs: dict[str, list[dict]]) -> str:
    head = ("| variant | E_in / E_out / layers | params pre-train / fine-tune | tokens | seeds "
            "| valid MLM loss (lang avg) | retrieval avg (middle layer) | retrieval, best layer "
            "| retrieval, centered | zero-shot acc (transfer avg) | zero-shot balanced acc |")
    lines = [head, "|" + "---|" * 11]
    for variant, results in runs.items():
        first = results[0]
        m = first["model"]
        rows = [figures(r) for r in results]
        tied = " tied" if m["tie_embeddings"] else ""
        lines.append(
            f"| {variant} | {m['input_embedding_size']} / {m['output_embedding_size']}{tied} / "
            f"{m['num_hidden_layers']} | {first['parameters']['pretraining'] / 1e6:.2f}M / "
            f"{first['parameters']['finetuning'] / 1e6:.2f}M | {first['tokens'] / 1e6:.1f}M | "
            f"{len(results)} | {spread([r['valid_loss_lang_avg'] for r in rows])} | "
            f"{spread([r['retrieval'] for r in rows])} | "
            f"{spread([r['retrieval_best_layer'] for r in rows])} | "
            f"{spread([r['retrieval_centered'] for r in rows])} | "
            f"{spread([r['zero_shot'] for r in rows])} | "
            f"{spread([r['zero_shot_balanced'] for r in rows])} |")
    for variant, results in runs.items():  # step 0 of every variant, beside it
        rows = [figures(r, "step0") for r in results]
        lines.append(f"| {variant} at step 0 | | | 0 | {len(results)} | | "
                     f"{spread([r['retrieval'] for r in rows])} | "
                     f"{spread([r['retrieval_best_layer'] for r in rows])} | "
                     f"{spread([r['retrieval_centered'] for r in rows])} | "
                     f"{spread([r['zero_shot'] for r in rows])} | "
                     f"{spread([r['zero_shot_balanced'] for r in rows])} |")
    any_run = next(iter(runs.values()))[0]["eval"]
    retrieval, cls = any_run.get("retrieval", {}), any_run.get("classification", {})
    bag_r = both_ways(retrieval["average"]["bag"]) if "bag" in retrieval.get("average", {}) \
        else None
    bag_c = cls.get("average_transfer", {}).get("bag", {}).get("accuracy")
    bag_cb = cls.get("average_transfer", {}).get("bag", {}).get("balanced")
    centered = next(iter(runs.values()))[0].get("eval_centered", {}).get("retrieval", {})
    bag_rc = both_ways(centered["average"]["bag"]) if "bag" in centered.get("average", {}) \
        else None
    lines.append(f"| bag of tokens (no model) | | | | | | {spread([bag_r])} | | "
                 f"{spread([bag_rc])} | {spread([bag_c])} | {spread([bag_cb])} |")
    chance_c = cls.get("average_transfer", {}).get("majority")
    uniform = cls.get("average_transfer", {}).get("uniform")
    lines.append(f"| chance (1/N; majority label; 1/K) | | | | | | "
                 f"{spread([retrieval.get('average', {}).get('chance')])} | | | "
                 f"{spread([chance_c])} | {spread([uniform])} |")
    return "\n".join(lines)


def language_table(runs: dict[str, list[dict]]) -> str:
    """Validation MLM loss per language at the end (equal tokens), mean over seeds."""
    langs = sorted({lang for results in runs.values() for r in results
                    for lang in (r["metrics"]["valid"] or {}).get("languages", {})})
    lines = ["| variant | " + " | ".join(langs) + " |", "|" + "---|" * (len(langs) + 1)]
    for variant, results in runs.items():
        cells = []
        for lang in langs:
            values = [(r["metrics"]["valid"] or {}).get("languages", {}).get(lang, {}).get("loss")
                      for r in results]
            values = [v for v in values if v is not None]
            cells.append(f"{statistics.fmean(values):.3f}" if values else "-")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], out: Path) -> None:
    """Three panels: validation MLM loss by step; retrieval (middle layer, both ways) by step
    with each variant's step-0 figure dashed and the bag of tokens dotted; the transfer figures
    per variant, trained beside step 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, retrieval, bars) = plt.subplots(1, 3, figsize=(17, 4.6))
    for i, (variant, results) in enumerate(runs.items()):
        for r in results:
            first = r is results[0]
            curve = r["metrics"]["valid_curve"]
            curves.plot([s for s, _ in curve], [v for _, v in curve], color=f"C{i}",
                        alpha=0.8, label=variant if first else None)
            rc = r["metrics"].get("retrieval_curve", [])
            retrieval.plot([s for s, _, _ in rc], [(a + b) / 2 for _, a, b in rc],
                           color=f"C{i}", alpha=0.8, label=variant if first else None)
            step0 = figures(r, "step0")["retrieval"]
            # comparable only where the curve and the final evaluation used the same pairs
            same = r.get("retrieval_curve_pairs") == r["eval"].get("settings", {}).get(
                "max_pairs")
            if step0 is not None and rc and same:
                retrieval.hlines(step0, 0, rc[-1][0], colors=f"C{i}", linestyles="dashed",
                                 alpha=0.6)
    bag = next(iter(runs.values()))[0]["eval"].get("retrieval", {}).get("average", {})
    if "bag" in bag:
        retrieval.axhline(both_ways(bag["bag"]), color="k", linestyle="dotted",
                          label="bag of tokens")
    curves.set(xlabel="step", ylabel="validation MLM loss", title="pre-training")
    curves.legend(fontsize=8)
    retrieval.set(xlabel="step", ylabel="retrieval acc@1 (both ways)",
                  title="retrieval while training (dashed: step 0)")
    retrieval.legend(fontsize=8)
    names = list(runs)
    measures = (("retrieval", "retrieval"), ("retrieval_centered", "retrieval, centered"),
                ("zero_shot_balanced", "zero-shot balanced acc"))
    width = 0.8 / (2 * len(measures))
    for j, (key, label) in enumerate(measures):
        for k, encoder in enumerate(("model", "step0")):
            means = []
            for variant in names:
                vals = [figures(r, encoder)[key] for r in runs[variant]]
                vals = [v for v in vals if v is not None]
                means.append(statistics.fmean(vals) if vals else 0.0)
            xs = [x - 0.4 + width * (2 * j + k + 0.5) for x in range(len(names))]
            bars.bar(xs, means, width=width, color=f"C{j}",
                     alpha=1.0 if encoder == "model" else 0.35,
                     label=f"{label} ({'trained' if encoder == 'model' else 'step 0'})")
    bars.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    bars.set_title("transfer, trained (solid) and step 0 (pale)")
    bars.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", default="cpu-small")
    p.add_argument("--tag", default="sweep")
    p.add_argument("--plot", type=Path, help="write the figure here (PNG)")
    args = p.parse_args(argv)
    runs = load(args.scale, args.tag)
    if not runs:
        sys.exit(f"error: no result files under {HERE / 'results' / args.scale / args.tag}")
    print(table(runs))
    print()
    print(language_table(runs))
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
