"""A synthetic, structured multilingual corpus for the demo and the tests (offline,
deterministic given the seed).

Each language has its own script, a vocabulary of made-up words with Zipf-distributed
frequencies, two noun classes with agreeing determiners and verb suffixes, and a fixed word
order (SVO, SOV or VSO; adjective before or after the noun). An MLM can therefore learn
something real: which determiner goes with a noun, which suffix a verb takes, where the verb
goes. Languages get unequal amounts of text so that alpha-sampling matters.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_rembert.fs import write_errors


def _chars(a: int, b: int) -> str:
    return "".join(chr(c) for c in range(a, b + 1))


# script -> (consonants, vowels). Vowels "" = an abjad (consonant-only words).
SCRIPTS = {
    "latn": ("bcdfghklmnprstvz", "aeiou"),
    "latn2": ("bdfgjklmnprstvwz", "aeiouäöü"),
    "cyrl": ("бвгдзклмнпрстфхчш", "аеиоуыя"),
    "grek": ("βγδζθκλμνπρστφχ", "αεηιουω"),
    "arab": ("بتثجحخدذرزسشصضطعغفقكلمنهوي", ""),
    "deva": ("कखगचजटडतदनपबमयरलवसह", "ािीुूेो"),
    "hani": (_chars(0x4E00, 0x4E00 + 299), ""),  # small: tests use a 1000-piece vocabulary
    "hang": (_chars(0xAC00, 0xAC00 + 199), ""),
}


@dataclass(frozen=True)
class DemoLanguage:
    code: str
    script: str
    order: str  # "SVO", "SOV" or "VSO"
    adj_after_noun: bool
    spaces: bool  # False: words are written without spaces (as in Chinese)
    end: str  # sentence-final punctuation
    share: float  # fraction of the corpus bytes


LANGUAGES = [
    DemoLanguage("latn_a", "latn", "SVO", False, True, ".", 0.26),
    DemoLanguage("latn_b", "latn2", "SOV", True, True, ".", 0.16),
    DemoLanguage("cyrl", "cyrl", "SVO", False, True, ".", 0.14),
    DemoLanguage("grek", "grek", "VSO", True, True, ";", 0.10),
    DemoLanguage("arab", "arab", "VSO", True, True, ".", 0.10),
    DemoLanguage("deva", "deva", "SOV", False, True, "।", 0.09),
    DemoLanguage("hani", "hani", "SVO", False, False, "。", 0.08),
    DemoLanguage("hang", "hang", "SOV", False, True, ".", 0.07),
]


def _make_words(rng: np.random.Generator, script: str, n: int, syllables: tuple[int, int],
                taken: set[str]) -> list[str]:
    cons, vows = SCRIPTS[script]
    words: list[str] = []
    for _ in range(100 * n):  # bounded: a too-small alphabet fails instead of looping forever
        if len(words) == n:
            return words
        k = int(rng.integers(syllables[0], syllables[1] + 1))
        w = "".join(cons[rng.integers(len(cons))] + (vows[rng.integers(len(vows))] if vows else "")
                    for _ in range(k))
        if w not in taken:
            taken.add(w)
            words.append(w)
    raise ValueError(f"script {script!r} has too few distinct words of {syllables} syllables")


def _zipf_cdf(n: int, s: float = 1.07) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1) ** s
    return np.cumsum(p / p.sum())


class _Grammar:
    def __init__(self, lang: DemoLanguage, seed: int):
        rng = np.random.Generator(np.random.Philox(key=[seed, sum(map(ord, lang.code))]))
        self.lang, self.rng, taken = lang, rng, set()
        short = (1, 1) if lang.script in ("hani", "hang") else (1, 2)
        longer = (1, 2) if lang.script in ("hani", "hang") else (2, 3)
        # short words first: the content words could otherwise use up every short form
        self.dets = _make_words(rng, lang.script, 4, short, taken)  # [class][definite]
        self.suffix = _make_words(rng, lang.script, 2, (1, 1), taken)  # verb agrees with subject
        self.nouns = _make_words(rng, lang.script, 1500, longer, taken)
        self.verbs = _make_words(rng, lang.script, 300, longer, taken)
        self.adjs = _make_words(rng, lang.script, 200, longer, taken)
        self.c_noun, self.c_verb, self.c_adj = _zipf_cdf(1500), _zipf_cdf(300), _zipf_cdf(200)

    def _draw(self, cdf: np.ndarray) -> int:
        return min(int(np.searchsorted(cdf, self.rng.random())), len(cdf) - 1)

    def _np(self) -> tuple[list[str], int]:
        r = self.rng
        n = self._draw(self.c_noun)
        cls = n % 2  # noun class: fixed per noun, so determiner agreement is learnable
        words = [self.dets[2 * cls + int(r.integers(2))]]
        noun = [self.nouns[n]]
        if r.random() < 0.4:
            adj = [self.adjs[self._draw(self.c_adj)]]
            noun = noun + adj if self.lang.adj_after_noun else adj + noun
        return words + noun, cls

    def sentence(self) -> str:
        subj, cls = self._np()
        obj, _ = self._np()
        verb = [self.verbs[self._draw(self.c_verb)] + self.suffix[cls]]
        parts = {"SVO": (subj, verb, obj), "SOV": (subj, obj, verb), "VSO": (verb, subj, obj)}
        words = [w for part in parts[self.lang.order] for w in part]
        return (" " if self.lang.spaces else "").join(words) + self.lang.end

    def document(self) -> str:
        n = int(self.rng.integers(2, 13))
        return (" " if self.lang.spaces else "").join(self.sentence() for _ in range(n))


def _open_out(path: Path):
    if path.suffix == ".gz":
        # mtime=0 and no file name in the header: the same seed gives byte-identical files
        return gzip.GzipFile(filename="", mode="wb", fileobj=open(path, "wb"), mtime=0)
    return open(path, "wb")


def make_demo_corpus(
    out_dir: str | os.PathLike, size_mb: float = 4.0, seed: int = 1234,
    languages: list[str] | None = None,
) -> dict[str, int]:
    """Write `out_dir/<lang>/...` (about `size_mb` MB of UTF-8 text in all) and return the
    number of documents per language. Formats vary on purpose: `latn_a` is split over two
    .txt files, `cyrl` is .jsonl.gz, `deva` is .txt.gz, the rest plain .txt."""
    out_dir = Path(out_dir)
    chosen = [lang for lang in LANGUAGES if languages is None or lang.code in languages]
    total_share = sum(lang.share for lang in chosen)
    docs = {}
    for lang in chosen:
        d = out_dir / lang.code
        d.mkdir(parents=True, exist_ok=True)
        g = _Grammar(lang, seed)
        target = size_mb * 1e6 * lang.share / total_share
        names = {"cyrl": ["part-00000.jsonl.gz"], "deva": ["part-00000.txt.gz"],
                 "latn_a": ["part-00000.txt", "part-00001.txt"]}.get(lang.code, ["part-00000.txt"])
        written, n_docs = 0, 0
        for i, name in enumerate(names):
            with write_errors(d / name), _open_out(d / name) as f:  # one line naming it
                while written < target * (i + 1) / len(names):
                    text = g.document()
                    line = json.dumps({"text": text}, ensure_ascii=False) if ".jsonl" in name \
                        else text
                    data = (line + "\n").encode("utf-8")
                    f.write(data)
                    written += len(data)
                    n_docs += 1
        docs[lang.code] = n_docs
    return docs
