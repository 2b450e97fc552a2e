"""What an evaluation prints (tables, every system side by side) and writes (`--out`: one
JSON object, sorted keys, schema in docs/eval.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_rembert.cli import format_table
from megatron_rembert.config import EXECUTION_FIELDS
from megatron_rembert.eval.classify import head_parameters
from megatron_rembert.eval.encoder import ModelSource
from megatron_rembert.eval.settings import Settings
from megatron_rembert.fs import atomic_write_json
from megatron_rembert.model.sizes import parameter_counts

SCHEMA_VERSION = 1
SYSTEMS = (("model", "model"), ("step0", "step 0"), ("bag", "bag"))


def identity(source: ModelSource, settings: Settings, num_labels: int | None) -> dict:
    """The model evaluated: where from, its architecture and sizes, its tokenizer."""
    counts = parameter_counts(source.config)
    head = head_parameters(source.config.hidden_size, num_labels) if num_labels else None
    config = {k: v for k, v in dataclasses.asdict(source.config).items()
              if k not in EXECUTION_FIELDS}
    return {"source": source.kind, "path": str(source.path), "step": source.step,
            "config": config,
            "parameters": {"pretraining": counts.pretraining, "encoder": counts.finetuning,
                           "classifier_head": head,
                           "finetuning": counts.finetuning + head if head else None},
            "tokenizer": {"path": str(source.tokenizer.path),
                          "sha256": source.tokenizer.sha256},
            "step0_seed": source.seed if settings.init_seed is None else settings.init_seed}


def document(source: ModelSource, settings: Settings, results: dict) -> dict:
    labels = results.get("classification", {}).get("labels")
    return {"schema_version": SCHEMA_VERSION,
            "model": identity(source, settings, len(labels) if labels else None),
            "settings": dataclasses.asdict(settings), **results}


def write_json(path: str | Path, doc: dict) -> None:
    atomic_write_json(path, doc)


def _two(pair: dict | None) -> str:
    return "-" if pair is None else f"{pair['to_en']:.3f} / {pair['from_en']:.3f}"


def _spread(entry: dict | None) -> str:
    return "-" if entry is None else f"{entry['mean']:.3f} ± {entry['std']:.3f}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def retrieval_table(res: dict, settings: Settings, num_layers: int) -> str:
    names = [(k, t) for k, t in SYSTEMS if any(k in e for e in res["languages"].values())]
    bag = f"bag ({settings.bag_weighting})"
    header = ["lang", "pairs", *[bag if k == "bag" else t for k, t in names], "chance"]
    rows = [[lang, e["pairs"], *[_two(e.get(k)) for k, _ in names], _num(e.get("chance"))]
            for lang, e in sorted(res["languages"].items())]
    avg = res["average"]
    rows.append(["average", "", *[_two(avg.get(k)) for k, _ in names], _num(avg.get("chance"))])
    title = (f"Retrieval accuracy@1, lang->en / en->lang: mean-pooled layer {res['layer']} of "
             f"{num_layers} (0 = embeddings), cosine"
             + (", each language's mean subtracted (--center)" if settings.center else ""))
    out = [title, format_table(header, rows)]
    if "per_layer" in res:
        systems = list(res["per_layer"])
        header = ["layer", *[dict(SYSTEMS)[k] for k in systems]]
        rows = [[str(i), *[_two(res["per_layer"][k][i]["average"]) for k in systems]]
                for i in range(len(res["per_layer"][systems[0]]))]
        out += ["", "Retrieval by layer, average over languages (lang->en / en->lang)",
                format_table(header, rows)]
    return "\n".join(out)


def classification_table(res: dict, settings: Settings, balanced: bool = False) -> str:
    """Accuracy (chance: the majority label's share, and 1/K), or with `balanced` the mean
    recall over the labels (chance 1/K whatever the labels' shares)."""
    names = [(k, t) for k, t in SYSTEMS if any(k in e for e in res["languages"].values())]
    chance = ["1/K"] if balanced else ["majority", "1/K"]
    header = ["lang", "examples", *[f"{t} (mean ± std)" if k != "bag" else t
                                    for k, t in names], *chance]

    def cells(e: dict) -> list[str]:
        out = []
        for k, _ in names:
            if k not in e:
                out.append("-")
            elif k == "bag":
                out.append(_num(e["bag"]["balanced" if balanced else "accuracy"]))
            else:
                out.append(_spread(e[k]["balanced"] if balanced else e[k]))
        return out + ([] if balanced else [_num(e.get("majority"))]) + [_num(e.get("uniform"))]

    rows = [[lang, e["examples"], *cells(e)] for lang, e in sorted(res["languages"].items())]
    for key, label in (("average", "average"), ("average_transfer",
                                                f"average without {res['train_lang']}")):
        if key in res:
            rows.append([label, "", *cells(res[key])])
    what = ("Zero-shot classification, balanced accuracy (mean recall over the labels)"
            if balanced else "Zero-shot classification accuracy")
    title = (f"{what}: fine-tuned on {res['train_lang']} only "
             f"({res['train_examples']} examples, {len(res['labels'])} labels, "
             f"{settings.seeds} seeds, {settings.epochs} epochs, lr {settings.lr:g}; "
             f"classifier on the {res['pooling']})")
    return "\n".join([title, format_table(header, rows)])


def console(doc: dict, settings: Settings) -> str:
    m = doc["model"]
    step = f" (step {m['step']})" if m["step"] is not None else ""
    p = m["parameters"]
    lines = [f"model: {m['source']} {m['path']}{step}; parameters: pre-training "
             f"{p['pretraining']:,}, encoder {p['encoder']:,}"
             + (f", fine-tuning {p['finetuning']:,}" if p["finetuning"] else "")
             + f"; step 0 = seed {m['step0_seed']}"]
    if "retrieval" in doc:
        lines += ["", retrieval_table(doc["retrieval"], settings,
                                      m["config"]["num_hidden_layers"])]
    if "classification" in doc:
        lines += ["", classification_table(doc["classification"], settings),
                  "", classification_table(doc["classification"], settings, balanced=True)]
    return "\n".join(lines)
