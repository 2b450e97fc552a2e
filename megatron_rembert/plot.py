"""Training and per-language validation curves of one or more runs, in one figure.

    rembert-plot LOG_DIR [LOG_DIR ...] --out runs.png [--labels A B ...]
    (or python -m megatron_rembert.plot ...)

Reads each folder's metrics.jsonl (train.py writes it into train.log_dir) and draws four
panels against the step: training loss, training MLM accuracy, validation loss and validation
MLM accuracy; and two more where a run measured retrieval (eval.retrieval_path): accuracy@1
to and from English. Each run has one colour; in the validation and retrieval panels its
overall curve (token-weighted; for retrieval the mean over languages) is the thick line and
each language a thin line of the same colour, labelled at its last point. A resumed run
logs the steps after its last checkpoint twice: the later row wins.
Needs matplotlib (`pip install -e '.[plot]'`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_rembert.cli import prog, run_cli
from megatron_rembert.errors import UserError

PANELS = (("train", "loss", "training loss"), ("train", "mlm_acc", "training MLM accuracy"),
          ("valid", "loss", "validation loss"), ("valid", "mlm_acc", "validation MLM accuracy"))
RETRIEVAL_PANELS = (("valid", "retrieval_to_en", "retrieval accuracy@1, language -> English"),
                    ("valid", "retrieval_from_en", "retrieval accuracy@1, English -> language"))


class PlotError(UserError):
    """Bad input to the plot command; the message names the file."""


def read_metrics(log_dir: str | Path) -> dict[str, dict[int, dict]]:
    """{split: {step: row}} from LOG_DIR/metrics.jsonl, the later row winning for a step. A
    last line cut off by a crash is ignored; any other unreadable line is an error."""
    path = Path(log_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path}: no such file (pass the run's train.log_dir)")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    rows: dict[str, dict[int, dict]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.setdefault(row["split"], {})[int(row["step"])] = row
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            if number == len(lines):
                break  # cut off mid-write
            raise PlotError(f"{path}:{number}: not a metrics row ({err})") from err
    return rows


def curves(rows: dict[str, dict[int, dict]], split: str, key: str) -> dict[str, tuple]:
    """{"": (steps, values)} for the split's overall curve and, for validation, one
    {lang: (steps, values)} per language."""
    by_step = sorted(rows.get(split, {}).items())
    out = {"": ([s for s, r in by_step if key in r], [r[key] for _, r in by_step if key in r])}
    for step, row in by_step:
        for lang, numbers in row.get("languages", {}).items():
            if key in numbers:
                steps, values = out.setdefault(lang, ([], []))
                steps.append(step)
                values.append(numbers[key])
    return out


def plot_runs(log_dirs: list[str | Path], labels: list[str] | None = None):
    """The figure (matplotlib.figure.Figure, no display needed) of `log_dirs`' runs."""
    from matplotlib.figure import Figure

    labels = labels or [Path(d).name or str(d) for d in log_dirs]
    runs = [read_metrics(d) for d in log_dirs]
    retrieval = any("retrieval_to_en" in row for rows in runs
                    for row in rows.get("valid", {}).values())
    panels = PANELS + RETRIEVAL_PANELS if retrieval else PANELS
    fig = Figure(figsize=(13, 4.5 * (len(panels) // 2)), layout="constrained")
    axes = fig.subplots(len(panels) // 2, 2)
    for ax, (split, key, title) in zip(axes.flat, panels, strict=True):
        for i, (rows, label) in enumerate(zip(runs, labels, strict=True)):
            color = f"C{i % 10}"
            for lang, (steps, values) in curves(rows, split, key).items():
                if not steps:
                    continue
                if lang:
                    ax.plot(steps, values, color=color, linewidth=0.8, alpha=0.45)
                    ax.annotate(lang, (steps[-1], values[-1]), color=color, fontsize=7)
                else:
                    ax.plot(steps, values, color=color, linewidth=2, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    return fig


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog=prog("python -m megatron_rembert.plot"),
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log_dirs", nargs="+", help="train.log_dir of each run")
    parser.add_argument("--out", required=True, help="image file (.png, .pdf or .svg)")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: the "
                        "folder names)")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.log_dirs):
        parser.error(f"--labels: {len(args.labels)} labels for {len(args.log_dirs)} runs")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError("plotting needs matplotlib: pip install -e '.[plot]'") from None
    fig = plot_runs(args.log_dirs, args.labels)
    try:
        fig.savefig(args.out, dpi=120)
    except (OSError, ValueError) as err:  # unwritable --out, an unknown image suffix
        raise PlotError(f"--out {args.out}: {err}") from err
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
