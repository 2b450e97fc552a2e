"""Aligned paragraphs -> the corpus documents, the parallel pairs and the topic task.

Inputs are pages as help_pages.py reads them ({path under text/: Page}); English is the pivot,
given as {path: {par id: text}}. A paragraph of another language is kept when English has it
(same page, same par id), its text differs from the English one (equal text is an untranslated
fallback), neither holds the help compiler's "not found" mark of a missing embedded section,
and the English text has at least `min_chars` characters: measured on English, so that the
same paragraphs pass in every language, whatever its script. English keeps its paragraphs of
`min_chars` or more (without the mark).

Pages, not paragraphs, are split: a page is held out for evaluation when
`unit_hash("eval", seed, path) < eval_fraction`, in every language at once, so no held-out text
(nor its translation) is in the corpus; held-out pages are halved by `unit_hash("topic", seed,
path) < 0.5` (the topic task's train half). Every choice is a function of the paths, the ids
and the seed, so the same packages and settings give the same sets.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from megatron_rembert.prep.help_pages import Page

# The help compiler's mark of an embedded section it could not find, left in some pages.
BROKEN_EMBED = re.compile(r"\[text/[^\]]*\.xhp#[^\]]* not found\]")
Kept = dict[str, list[tuple[str, str]]]  # page path -> [(par_id, text)] in page order


def unit_hash(*parts: object) -> float:
    """A stable number in [0, 1) from `parts` (sha256: the same on every machine and run)."""
    digest = hashlib.sha256("\n".join(map(str, parts)).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_held_out(path: str, seed: int, eval_fraction: float) -> bool:
    return unit_hash("eval", seed, path) < eval_fraction


def topic_half(path: str, seed: int) -> str:
    """Which half of the topic task a held-out page feeds: "train" or "test"."""
    return "train" if unit_hash("topic", seed, path) < 0.5 else "test"


@dataclass
class LanguageCounts:
    """Per-language figures of summary.json (see docs/data.md for each one's meaning)."""

    package: str = ""
    sha256: str = ""
    pages: int = 0
    pages_skipped: dict[str, int] = field(default_factory=dict)
    paragraphs: int = 0
    repeated_ids: int = 0
    aligned: int = 0
    untranslated: int = 0
    broken_embed: int = 0
    too_short: int = 0
    kept: int = 0
    corpus_documents: int = 0
    corpus_paragraphs: int = 0
    eval_paragraphs: int = 0
    parallel_pairs: int = 0
    parallel_duplicates: int = 0
    topic_test: int = 0


def keep_paragraphs(pages: dict[str, Page], english: dict[str, dict[str, str]] | None,
                    min_chars: int, counts: LanguageCounts) -> Kept:
    """{page: [(par_id, text) kept, page order]}; `english` is None for the pivot itself, else
    {page: {par id: English text}}. Counts what is dropped and why into `counts`."""
    kept = {}
    for path, page in pages.items():
        en_page = None if english is None else english.get(path, {})
        out = []
        for par_id, text in page.paragraphs:
            en = text if en_page is None else en_page.get(par_id)
            if en is None:
                continue  # not aligned: nothing to compare with, so not kept
            counts.aligned += 1
            if en_page is not None and text == en:
                counts.untranslated += 1
            elif BROKEN_EMBED.search(text) or BROKEN_EMBED.search(en):
                counts.broken_embed += 1
            elif len(en) < min_chars or not text:
                counts.too_short += 1
            else:
                out.append((par_id, text))
        counts.kept += len(out)
        if out:
            kept[path] = out
    return kept


def corpus_lines(kept: Kept, held: set[str],
                 counts: LanguageCounts) -> list[str]:
    """One document per page not held out (sorted by path): its paragraphs joined by a space."""
    lines = []
    for path in sorted(kept):
        if path in held:
            counts.eval_paragraphs += len(kept[path])
        else:
            lines.append(" ".join(text for _, text in kept[path]))
            counts.corpus_paragraphs += len(kept[path])
    counts.corpus_documents = len(lines)
    return lines


def parallel_rows(kept: Kept, english: dict[str, dict[str, str]],
                  pages: dict[str, Page], held: set[str], counts: LanguageCounts) -> list[dict]:
    """The held-out kept paragraphs with their English text, sorted by id. A pair whose English
    or own text already came (earlier id) is dropped and counted, so that retrieval never has
    two identical candidates."""
    rows = sorted(({"id": f"{path}#{par_id}", "label": pages[path].module, "text": text,
                    "en": english[path][par_id]}
                   for path in held & kept.keys() for par_id, text in kept[path]),
                  key=lambda r: r["id"])
    seen_en, seen_text, out = set(), set(), []
    for row in rows:
        if row["en"] in seen_en or row["text"] in seen_text:
            counts.parallel_duplicates += 1
            continue
        seen_en.add(row["en"])
        seen_text.add(row["text"])
        out.append(row)
    counts.parallel_pairs = len(out)
    return out


@dataclass
class TopicSets:
    """The zero-shot topic task. `train`: English paragraphs of train-half pages (exact
    duplicates once), labels with at least `topic_min_train` of them, each capped at
    `topic_max_train` (the paragraphs with the smallest unit_hash("pick", seed, id)).
    `test` rows come from test-half pages in every language, minus those whose English text is
    in a train-half page (no sentence is both learnt and tested)."""

    train: list[dict]
    labels: dict[str, dict[str, int]]  # label -> {"candidates", "train", "test"}
    dropped_labels: dict[str, int]  # label -> candidates, below topic_min_train
    train_texts: set[str]
    test: list[dict] = field(default_factory=list)

    def add_test(self, lang: str, kept: Kept,
                 english: dict[str, dict[str, str]], pages: dict[str, Page], held: set[str],
                 seed: int, counts: LanguageCounts) -> None:
        for path in sorted(held & kept.keys()):
            label = pages[path].module
            if topic_half(path, seed) != "test" or label not in self.labels:
                continue
            for par_id, text in kept[path]:
                if english[path][par_id] not in self.train_texts:
                    self.test.append({"id": f"{path}#{par_id}", "lang": lang, "label": label,
                                      "text": text})
                    self.labels[label]["test"] += 1
                    counts.topic_test += 1


def topic_train(kept_en: Kept, pages: dict[str, Page], held: set[str], seed: int,
                min_train: int, max_train: int) -> TopicSets:
    candidates: dict[str, list[dict]] = {}
    texts: set[str] = set()
    for path in sorted(held & kept_en.keys()):
        if topic_half(path, seed) != "train":
            continue
        for par_id, text in kept_en[path]:
            if text not in texts:  # first by path, then page order
                texts.add(text)
                candidates.setdefault(pages[path].module, []).append(
                    {"id": f"{path}#{par_id}", "lang": "en", "label": pages[path].module,
                     "text": text})
    train, labels, dropped = [], {}, {}
    for label, rows in sorted(candidates.items()):
        if len(rows) < min_train:
            dropped[label] = len(rows)
            continue
        rows = sorted(rows, key=lambda r: unit_hash("pick", seed, r["id"]))
        train += rows[:max_train]
        labels[label] = {"candidates": len(rows), "train": min(len(rows), max_train),
                         "test": 0}
    return TopicSets(sorted(train, key=lambda r: r["id"]), labels, dropped, texts)


def jsonl(rows: list[dict]) -> list[str]:
    return [json.dumps(r, ensure_ascii=False, sort_keys=True) for r in rows]


def held_out_record(paths: set[str]) -> dict:
    """How many pages are held out, and the sha256 of their sorted list (one path a line)."""
    listing = "".join(f"{p}\n" for p in sorted(paths))
    return {"pages": len(paths), "sha256": hashlib.sha256(listing.encode()).hexdigest()}
