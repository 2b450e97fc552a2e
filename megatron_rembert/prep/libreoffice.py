"""`rembert-libreoffice-corpus`'s work: Debian's libreoffice-help-<lang> packages -> a
pre-training corpus, two evaluation sets and summary.json under one output folder.

Reading a package is help_pages.py; aligning, splitting and choosing the sets is
aligned_sets.py; the outputs appear together (staged_output.py). English (`en-us`, written as
`en`) is the pivot every language aligns with; the others keep their package's code (`de`,
`pt-br`, `zh-cn`). The formats are in docs/data.md ("Real text: LibreOffice help in 34
languages"). Packages are read one at a time, English first, so memory holds English and one
other language.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_rembert.cli import format_table
from megatron_rembert.data.common import DataError
from megatron_rembert.fs import sha256_file
from megatron_rembert.prep.aligned_sets import (
    LanguageCounts,
    corpus_lines,
    held_out_record,
    is_held_out,
    jsonl,
    keep_paragraphs,
    parallel_rows,
    topic_train,
)
from megatron_rembert.prep.help_pages import (
    HELP_ROOT,
    PACKAGE_PREFIX,
    Page,
    check_package,
    package_code,
    read_help_pages,
)
from megatron_rembert.prep.staged_output import StagedOutput

PIVOT = "en-us"
TOOL = "rembert-libreoffice-corpus"


@dataclass(frozen=True)
class LibreOfficeConfig:
    """Settings of one run; every default lives here (the command line shows them)."""

    debs: str
    out: str
    languages: tuple[str, ...] | None = None  # package codes; None: every package in `debs`
    eval_fraction: float = 0.1
    min_chars: int = 20
    seed: int = 0
    topic_min_train: int = 20  # a label needs this many English train paragraphs...
    topic_max_train: int = 300  # ...and keeps at most this many (so `shared` cannot dominate)

    def check(self) -> None:
        if not 0.0 < self.eval_fraction < 1.0:
            raise DataError(f"--eval-fraction {self.eval_fraction}: must lie strictly between "
                            "0 and 1 (0.1 holds out a tenth of the pages)")
        if self.min_chars < 0:
            raise DataError(f"--min-chars {self.min_chars}: must be 0 or more")
        if not 1 <= self.topic_min_train <= self.topic_max_train:
            raise DataError(f"topic_min_train {self.topic_min_train} and topic_max_train "
                            f"{self.topic_max_train}: need 1 <= min <= max")


def output_code(code: str) -> str:
    """The language code of the outputs: `en` for the pivot, else the package's code."""
    return "en" if code == PIVOT else code


def find_packages(debs: Path, languages: tuple[str, ...] | None) -> dict[str, Path]:
    """{package code: .deb} of `debs`, all of them or those of `languages` (the pivot is always
    included). Errors name the missing code or the duplicated packages."""
    if not debs.is_dir():
        raise DataError(f"--debs {debs}: not a folder")
    found: dict[str, list[Path]] = {}
    for path in sorted(debs.iterdir()):
        if (code := package_code(path.name)) is not None and path.is_file():
            found.setdefault(code, []).append(path)
    wanted = sorted(set(found if languages is None else languages) | {PIVOT})
    for code in wanted:
        if code not in found:
            have = ", ".join(sorted(found)) or "none"
            raise DataError(f"no {PACKAGE_PREFIX}{code}_*.deb in --debs {debs} (found: {have}); "
                            f"fetch it with: apt-get download {PACKAGE_PREFIX}{code}")
        if len(found[code]) > 1:
            names = ", ".join(p.name for p in found[code])
            raise DataError(f"--debs {debs} holds {len(found[code])} packages of {code} "
                            f"({names}); keep one")
    return {code: found[code][0] for code in wanted}


# The files this command writes under --out (a rerun may replace them; see staged_output.py).
OWNED = re.compile(r"summary\.json|corpus/[a-z0-9-]+/help\.txt|eval/parallel/[a-z0-9-]+\.jsonl"
                   r"|eval/topic/(train|test)\.jsonl")
SUMMARY = "summary.json"


def build_libreoffice_corpus(cfg: LibreOfficeConfig,
                             progress: Callable[[str], None] = lambda line: None) -> dict:
    """Read the packages, write OUT's corpus, eval sets and summary.json; returns the summary.

    Every package is checked as an archive (headers only) before any is unpacked; the outputs
    appear in OUT only when all of them are written (StagedOutput)."""
    cfg.check()
    packages = find_packages(Path(cfg.debs), cfg.languages)
    for path in packages.values():
        check_package(path)
    out = StagedOutput(cfg.out, OWNED)
    out.begin()
    try:
        summary = _build(cfg, packages, out, progress)
        out.commit(SUMMARY, (json.dumps(summary, ensure_ascii=False, indent=1, sort_keys=True)
                             + "\n").encode("utf-8"))
    except BaseException:
        out.abort()
        raise
    return summary


def _read(path: Path, code: str, progress: Callable[[str], None]
          ) -> tuple[dict[str, Page], LanguageCounts]:
    start = time.perf_counter()
    pages, stats = read_help_pages(path, code)
    progress(f"read {path.name}: {stats.pages:,} pages, {stats.paragraphs:,} paragraphs "
             f"({time.perf_counter() - start:.1f} s)")
    return pages, LanguageCounts(path.name, sha256_file(path), stats.pages,
                                 dict(sorted(stats.skipped.items())), stats.paragraphs,
                                 stats.repeated_ids)


def _build(cfg: LibreOfficeConfig, packages: dict[str, Path], out: StagedOutput,
           progress: Callable[[str], None]) -> dict:
    en_pages, en_counts = _read(packages[PIVOT], PIVOT, progress)
    if not en_pages:
        raise DataError(f"{packages[PIVOT]}: no help pages under {HELP_ROOT}en-US/text/; the "
                        "English package is the pivot every language aligns with")
    held = {path for path in en_pages if is_held_out(path, cfg.seed, cfg.eval_fraction)}
    english = {path: dict(page.paragraphs) for path, page in en_pages.items()}
    kept = keep_paragraphs(en_pages, None, cfg.min_chars, en_counts)
    out.write_lines(f"corpus/{output_code(PIVOT)}/help.txt", corpus_lines(kept, held, en_counts))
    topic = topic_train(kept, en_pages, held, cfg.seed, cfg.topic_min_train,
                        cfg.topic_max_train)
    topic.add_test("en", kept, english, en_pages, held, cfg.seed, en_counts)
    counts, no_pages = {"en": en_counts}, {}
    for code in sorted(set(packages) - {PIVOT}):
        pages, c = _read(packages[code], code, progress)
        if not pages:
            no_pages[code] = f"{packages[code].name}: no help pages under {HELP_ROOT}{code}/text/"
            progress(f"skipped {no_pages[code]}")
            continue
        lang = output_code(code)
        kept = keep_paragraphs(pages, english, cfg.min_chars, c)
        if lines := corpus_lines(kept, held, c):
            out.write_lines(f"corpus/{lang}/help.txt", lines)
        out.write_lines(f"eval/parallel/{lang}.jsonl",
                        jsonl(parallel_rows(kept, english, pages, held, c)))
        topic.add_test(lang, kept, english, pages, held, cfg.seed, c)
        counts[lang] = c
    check_result(counts)
    out.write_lines("eval/topic/train.jsonl", jsonl(topic.train))
    out.write_lines("eval/topic/test.jsonl",
                    jsonl(sorted(topic.test, key=lambda r: (r["lang"], r["id"]))))
    return {
        "tool": TOOL,
        "settings": {k: v for k, v in asdict(cfg).items() if k not in ("debs", "out")},
        "inputs": {lang: {"package": c.package, "sha256": c.sha256} for lang, c in counts.items()},
        "languages": {lang: {k: v for k, v in asdict(c).items() if k not in ("package", "sha256")}
                      for lang, c in counts.items()},
        "packages_without_pages": no_pages,
        "held_out": held_out_record(held),
        "topic": {"labels": topic.labels, "dropped_labels": topic.dropped_labels},
        "files": dict(sorted(out.written.items())),
    }


def check_result(counts: dict[str, LanguageCounts]) -> None:
    if not any(c.kept for lang, c in counts.items() if lang != "en"):
        raise DataError("no paragraph of any language besides English was kept (none was both "
                        "aligned with English and translated): check the packages in --debs "
                        "and --languages")


def summary_table(summary: dict) -> str:
    """The console's table of the per-language figures."""
    keys = ["pages", "paragraphs", "aligned", "untranslated", "too_short", "kept",
            "corpus_paragraphs", "eval_paragraphs", "parallel_pairs", "topic_test"]
    head = ["lang", "pages", "paras", "aligned", "untransl", "short", "kept", "corpus", "eval",
            "pairs", "topic_test"]
    rows = [[lang] + [c[k] for k in keys] for lang, c in summary["languages"].items()]
    return format_table(head, rows)


def parse_languages(value: str) -> tuple[str, ...]:
    """`--languages de,pt-BR,en` -> ("de", "pt-br", "en-us"): package codes, lower case; `en`
    names the pivot's package."""
    codes = [c.strip().lower() for c in value.split(",") if c.strip()]
    bad = [c for c in codes if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", c)]
    if not codes or bad:
        raise argparse.ArgumentTypeError(f"{value!r}: expected package codes separated by "
                                         "commas, e.g. de,fr,pt-br")
    return tuple(sorted({PIVOT if c == "en" else c for c in codes}))
