"""One evaluation: every system (the model, step 0, the bag of tokens, chance) on every set.

`prepare` tokenises the sets and checks what depends on them (labels, languages) before any
weight is loaded; `run` computes the figures, returned as the JSON-ready dict that
report.py prints and writes (its schema is in docs/eval.md).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from megatron_rembert.data.parallel_text import ParallelSet
from megatron_rembert.eval import baselines
from megatron_rembert.eval.classify import (
    POOLING,
    accuracy,
    balanced_accuracy,
    finetune,
    predict,
    train_steps,
)
from megatron_rembert.eval.data import ClassificationSet, EvalDataError
from megatron_rembert.eval.embed import embed, n_batches
from megatron_rembert.eval.encoder import ModelSource, Tokenizer, step0_encoder
from megatron_rembert.eval.progress import Progress
from megatron_rembert.eval.settings import Settings
from megatron_rembert.model.retrieval import accuracy_at_1, center, chance


@dataclass
class Prepared:
    """The sets as token ids; what `run` needs besides the model."""

    retrieval: list[tuple[ParallelSet, list[str], list[list[int]]]] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)  # label names by index
    train: tuple[list[list[int]], list[int]] | None = None
    tests: dict[str, tuple[list[list[int]], list[int]]] = field(default_factory=dict)


def prepare(tokenizer: Tokenizer, settings: Settings, parallel: list[ParallelSet] | None,
            train: ClassificationSet | None, test: ClassificationSet | None) -> Prepared:
    """Tokenise (each distinct text of a language once) and check the label sets."""
    out = Prepared()
    for pset in parallel or []:
        unique = sorted(set(pset.texts) | set(pset.english))
        out.retrieval.append((pset, unique, tokenizer.encode(unique, settings.max_length)))
    if train is not None and test is not None:
        own = [e for e in train.examples if e.lang == settings.train_lang]
        if not own:
            raise EvalDataError(f"--classify-train {train.file}: no examples of --train-lang "
                                f"{settings.train_lang!r} (languages: {train.languages()})")
        out.labels = sorted({e.label for e in own})
        if len(out.labels) < 2:
            raise EvalDataError(f"--classify-train {train.file}: one label only "
                                f"({out.labels[0]!r}) in language {settings.train_lang!r}")
        index = {label: i for i, label in enumerate(out.labels)}
        for e in test.examples:
            if e.label not in index:
                raise EvalDataError(f"--classify-test {test.file}: label {e.label!r} "
                                    f"(language {e.lang}) never occurs in the training "
                                    f"examples ({out.labels})")
        out.train = (tokenizer.encode([e.text for e in own], settings.max_length),
                     [index[e.label] for e in own])
        for lang in test.languages():
            rows = [e for e in test.examples if e.lang == lang]
            out.tests[lang] = (tokenizer.encode([e.text for e in rows], settings.max_length),
                               [index[e.label] for e in rows])
    return out


def _units(prep: Prepared, settings: Settings, systems: int) -> int:
    per_system = sum(n_batches(len(seqs), settings.encode_batch_size)
                     for _, _, seqs in prep.retrieval)
    if prep.train is not None:
        evals = sum(n_batches(len(s), settings.encode_batch_size) for s, _ in prep.tests.values())
        per_system += settings.seeds * (train_steps(len(prep.train[0]), settings.epochs,
                                                    settings.batch_size) + evals)
    return systems * per_system


def _pair(forward: float, backward: float) -> dict:
    return {"to_en": forward, "from_en": backward}


def _mean_pairs(pairs: list[dict]) -> dict:
    return {k: statistics.fmean(p[k] for p in pairs) for k in ("to_en", "from_en")}


def _spread(runs: list[float]) -> dict:
    return {"mean": statistics.fmean(runs), "runs": runs,
            "std": statistics.stdev(runs) if len(runs) > 1 else 0.0}


def _retrieval(model, prep: Prepared, settings: Settings, pad_id: int, progress: Progress,
               name: str) -> dict[int, dict[str, dict]]:
    """{layer: {lang: {to_en, from_en}}} of one encoder."""
    out: dict[int, dict[str, dict]] = {layer: {} for layer in settings.layers}
    for pset, unique, seqs in prep.retrieval:
        progress.set_stage(f"{name}: retrieval {pset.lang}")
        vectors = embed(model, seqs, settings.layers, settings.encode_batch_size,
                        settings.device, pad_id, progress.advance)
        row = {text: i for i, text in enumerate(unique)}
        src = torch.tensor([row[t] for t in pset.texts])
        tgt = torch.tensor([row[t] for t in pset.english])
        for layer, v in vectors.items():
            a, b = (center(v[src]), center(v[tgt])) if settings.center else (v[src], v[tgt])
            out[layer][pset.lang] = _pair(*accuracy_at_1(a, b))
    return out


def _classification(model, prep: Prepared, settings: Settings, pad_id: int,
                    progress: Progress, name: str) -> dict[str, list[tuple[float, float]]]:
    """{lang: (accuracy, balanced accuracy) per seed} of one encoder fine-tuned on the train
    language."""
    seqs, labels = prep.train
    out: dict[str, list[tuple[float, float]]] = {lang: [] for lang in prep.tests}
    for seed in range(settings.seeds):
        progress.set_stage(f"{name}: fine-tuning, seed {seed}")
        clf = finetune(model, seqs, labels, len(prep.labels), seed, settings.epochs,
                       settings.lr, settings.batch_size, settings.device, pad_id,
                       progress.advance)
        for lang, (test_seqs, test_labels) in prep.tests.items():
            predicted = predict(clf, test_seqs, settings.encode_batch_size, settings.device,
                                pad_id)
            progress.advance(n_batches(len(test_seqs), settings.encode_batch_size))
            out[lang].append((accuracy(predicted, test_labels),
                              balanced_accuracy(predicted, test_labels)))
        del clf
    return out


def run(source: ModelSource, prep: Prepared, settings: Settings, progress: Progress) -> dict:
    """Every figure of docs/eval.md's schema except the model identity (report.py adds it)."""
    systems = {"model": None}
    if "step0" in settings.baselines:
        systems["step0"] = None
    progress.total = max(_units(prep, settings, len(systems)), 1)
    pad_id = source.tokenizer.special.pad
    retrieval: dict[str, dict] = {}
    classification: dict[str, dict] = {}
    for name in systems:
        progress.set_stage(f"{name}: loading")
        if name == "model":
            model = source.load_encoder()
        else:
            seed = source.seed if settings.init_seed is None else settings.init_seed
            model = step0_encoder(source.config, seed)
        model = model.to(settings.device)
        if prep.retrieval:
            retrieval[name] = _retrieval(model, prep, settings, pad_id, progress, name)
        if prep.train is not None:
            classification[name] = _classification(model, prep, settings, pad_id, progress,
                                                   name)
        del model
    progress.set_stage("bag of tokens")
    result = {}
    if prep.retrieval:
        result["retrieval"] = _retrieval_result(prep, settings, retrieval, source.tokenizer)
    if prep.train is not None:
        result["classification"] = _classification_result(prep, settings, classification,
                                                           source.tokenizer)
    return result


def _retrieval_result(prep: Prepared, settings: Settings, by_system: dict,
                      tokenizer: Tokenizer) -> dict:
    langs: dict[str, dict] = {}
    body = settings.max_length - 2
    for pset, _, _ in prep.retrieval:
        entry = {"file": str(pset.file), "pairs": len(pset), "pairs_read": pset.read,
                 "duplicates_dropped": pset.duplicates_dropped,
                 "identical_pairs": pset.identical_pairs}
        for name, layers in by_system.items():
            entry[name] = layers[settings.layer][pset.lang]
        if "bag" in settings.baselines:
            texts = [ids[:body] for ids in tokenizer.pieces(pset.texts)]
            english = [ids[:body] for ids in tokenizer.pieces(pset.english)]
            entry["bag"] = _pair(*baselines.bag_retrieval(texts, english,
                                                          settings.bag_weighting,
                                                          settings.center))
        if "chance" in settings.baselines:
            entry["chance"] = chance(len(pset))
        langs[pset.lang] = entry
    average = {name: _mean_pairs([langs[lang][name] for lang in langs])
               for name in [*by_system, *(["bag"] if "bag" in settings.baselines else [])]}
    if "chance" in settings.baselines:
        average["chance"] = statistics.fmean(e["chance"] for e in langs.values())
    out = {"layer": settings.layer, "languages": langs, "average": average}
    if len(settings.layers) > 1:
        out["per_layer"] = {name: [{"layer": layer, "average": _mean_pairs(list(res.values())),
                                    "languages": res} for layer, res in sorted(layers.items())]
                            for name, layers in by_system.items()}
    return out


def _seed_means(runs_by_language: list[list[float]], seeds: int) -> dict:
    """Per seed the mean over languages, then the spread of those over seeds."""
    return _spread([statistics.fmean(runs[s] for runs in runs_by_language)
                    for s in range(seeds)])


def _classification_result(prep: Prepared, settings: Settings, by_system: dict,
                           tokenizer: Tokenizer) -> dict:
    train_seqs, train_labels = prep.train
    langs: dict[str, dict] = {}
    bag = None
    if "bag" in settings.baselines:
        strip = lambda seqs: [s[1:-1] for s in seqs]  # noqa: E731 - [CLS] ... [SEP] off
        bag = baselines.bag_classification(strip(train_seqs), train_labels, len(prep.labels),
                                           {k: strip(s) for k, (s, _) in prep.tests.items()})
    for lang, (seqs, labels) in prep.tests.items():
        entry = {"examples": len(seqs)}
        for name, runs in by_system.items():
            entry[name] = {**_spread([a for a, _ in runs[lang]]),
                           "balanced": _spread([b for _, b in runs[lang]])}
        if bag is not None:
            entry["bag"] = {"accuracy": accuracy(bag[lang], labels),
                            "balanced": balanced_accuracy(bag[lang], labels)}
        if "chance" in settings.baselines:
            entry["majority"] = baselines.majority_rate(labels)
            entry["uniform"] = baselines.uniform_rate(len(prep.labels))
        langs[lang] = entry
    groups = {"average": list(langs),
              "average_transfer": [lang for lang in langs if lang != settings.train_lang]}
    out = {"train_lang": settings.train_lang, "train_examples": len(train_seqs),
           "labels": prep.labels, "pooling": POOLING, "languages": langs}
    for key, members in groups.items():
        if not members:
            continue
        avg = {}
        for name in by_system:  # per seed, the mean over languages; then over seeds
            runs = [langs[lang][name] for lang in members]
            avg[name] = {**_seed_means([e["runs"] for e in runs], settings.seeds),
                         "balanced": _seed_means([e["balanced"]["runs"] for e in runs],
                                                 settings.seeds)}
        if bag is not None:
            avg["bag"] = {key: statistics.fmean(langs[m]["bag"][key] for m in members)
                          for key in ("accuracy", "balanced")}
        if "chance" in settings.baselines:
            avg["majority"] = statistics.fmean(langs[m]["majority"] for m in members)
            avg["uniform"] = baselines.uniform_rate(len(prep.labels))
        avg["languages"] = members
        out[key] = avg
    return out
