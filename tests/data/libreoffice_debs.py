"""Help packages for the LibreOffice corpus tests, built in memory: an English pivot and two
languages (de with untranslated paragraphs and its pages in another order, pt-br with a
malformed page, an extra paragraph, a broken embed and a short translation), inline markup,
entities, ids repeated in a page (with the same text: kept once; with other text: ambiguous,
dropped), a sentence on every page.

`SPEC` holds the plain texts. What a language keeps (`expected_kept`) and which pages are held
out (`HELD`, by the documented rule: sha256 of "eval\\n<seed>\\n<page>") are computed from
them here, never by the code under test."""

from __future__ import annotations

import hashlib
import html
import io
import lzma
import tarfile
from pathlib import Path

MODULES = ["sbasic", "scalc", "shared", "swriter"]
PAGES = [f"{m}/guide/page{i}.html" for m in MODULES for i in range(6)]
FOLDERS = {"en-us": "en-US", "de": "de", "pt-br": "pt-BR"}
COMMON = "Choose Format - Cells to open the dialog."  # the same text on every page
MALFORMED = "sbasic/guide/page5.html"  # in pt-br only
FRACTION, MIN_TRAIN, MAX_TRAIN = 0.5, 2, 3


def _english(path: str) -> list[tuple[str, str]]:
    n = PAGES.index(path)
    paras = [(f"par_id{n}00", f"{path}: Tom & Jerry <b> in Zürich, first."),
             (f"par_id{n}01", f"{path}: second paragraph about {path.split('/')[0]}."),
             (f"par_id{n}02", f"{path}: a third paragraph with more words."),
             (f"par_id{n}03", "Short."),
             (f"par_id{n}04", COMMON),
             (f"par_id{n}05", f"{path}: the fifth paragraph.")]
    if n % 6 == 0:  # an embedded section repeats an id with other text: ambiguous
        paras.append((f"par_id{n}01", f"{path}: the repeated id's second text."))
    if n % 6 == 2:  # ... or with the same text: a plain repeat
        paras.append(paras[0])
    return paras


def _translate(lang: str, path: str, pid: str, en: str) -> str:
    if lang == "de" and pid.endswith("02"):
        return en  # untranslated: the English fallback
    if lang == "pt-br" and pid.endswith("01") and PAGES.index(path) % 6 == 1:
        return "[text/shared/00/x.xhp#y not found]"
    if lang == "pt-br" and pid.endswith("05"):
        return "五段"  # short, but --min-chars measures the English text
    return f"[{lang}] {en}"


SPEC = {"en-us": {p: _english(p) for p in PAGES}}
for _lang in ("de", "pt-br"):
    SPEC[_lang] = {p: [(pid, _translate(_lang, p, pid, en)) for pid, en in _english(p)]
                   for p in PAGES}


def _markup(text: str) -> str:
    """`text` as the help's HTML writes it: escaped, entities, inline tags, broken lines."""
    words = html.escape(text, quote=False).replace("ü", "&#252;").split(" ")
    words[0] = f'<a name="x"></a><span class="emph">{words[0]}</span>'
    return "\n      ".join([" ".join(words[:2]), "<br>".join(words[2:4]), " ".join(words[4:])])


def page_order(lang: str, paragraphs: list) -> list:
    return paragraphs[::-1] if lang == "de" else paragraphs  # de lists them in another order


def _page(lang: str, path: str) -> bytes:
    body = [f'<p id="{pid}" class="paragraph" dir="auto">{_markup(t)}</p>'
            for pid, t in page_order(lang, SPEC[lang][path])]
    if lang == "pt-br":
        body.append('<p id="par_idextra" dir="auto">A paragraph English does not have.</p>')
        if path == MALFORMED:
            body.append('<p id="par_idopen" dir="auto">never closed <div>')
    return ('<!DOCTYPE html>\n<html><head><title>t</title></head><body>\n<h1 id="hd_id1">Title'
            '</h1>\n<p class="nav">no id here</p>\n' + "\n".join(body) + "\n</body></html>\n"
            ).encode()


def ar(members: list[tuple[str, bytes]]) -> bytes:
    out = b"!<arch>\n"
    for name, data in members:
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data
        out += b"\n" if len(data) % 2 else b""
    return out


def tar(files: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            t.addfile(info)
    return buf.getvalue()


def deb(data_tar: bytes, member: str = "data.tar.xz") -> bytes:
    return ar([("debian-binary", b"2.0\n"), ("control.tar.xz", lzma.compress(tar({}))),
               (member, lzma.compress(data_tar) if member.endswith(".xz") else data_tar)])


def help_deb(lang: str) -> bytes:
    root = f"./usr/share/libreoffice/help/{FOLDERS[lang]}/"
    files = {f"{root}text/{p}": _page(lang, p) for p in PAGES}
    files[f"{root}bookmarks.js"] = b"var x;"
    if lang == "pt-br":
        files[f"{root}text/{MALFORMED}"] = _page("pt-br", MALFORMED)
    return deb(tar(files))


def deb_name(code: str) -> str:
    return f"libreoffice-help-{code}_4%3a7.4.7-1_all.deb"


def unit(*parts) -> float:
    return int.from_bytes(hashlib.sha256("\n".join(map(str, parts)).encode()).digest()[:8],
                          "big") / 2**64


def _good_seed() -> int:
    """The first seed whose split has held-out pages of every module in both topic halves."""
    for seed in range(100):
        held = [p for p in PAGES if unit("eval", seed, p) < FRACTION]
        halves = [{p.split("/")[0] for p in held if (unit("topic", seed, p) < 0.5) == h}
                  for h in (True, False)]
        if all(h == set(MODULES) for h in halves) and len(held) < len(PAGES):
            return seed
    raise AssertionError("no seed splits the fixture usefully")


SEED = _good_seed()
HELD = {p for p in PAGES if unit("eval", SEED, p) < FRACTION}


def n_texts(path: str, pid: str) -> int:
    return len({t for i, t in SPEC["en-us"][path] if i == pid})


def expected_kept(lang: str) -> dict[str, list[tuple[str, str, str]]]:
    """page -> [(par id, text, English text)] a language keeps, in its page order, from SPEC."""
    out = {}
    for path in PAGES:
        if lang == "pt-br" and path == MALFORMED:
            continue
        en, rows, seen = dict(SPEC["en-us"][path]), [], set()
        for pid, text in page_order(lang, SPEC[lang][path]):
            if n_texts(path, pid) > 1 or pid in seen:
                continue  # an ambiguous id, or a repeat
            seen.add(pid)
            if len(en[pid]) >= 20 and (lang == "en-us" or text != en[pid]) \
                    and "not found]" not in text:
                rows.append((pid, text, en[pid]))
        out[path] = rows
    return out


def write_debs(folder: Path) -> Path:
    """The three packages, under their Debian file names, in `folder`."""
    for lang in ("en-us", "de", "pt-br"):
        (folder / deb_name(lang)).write_bytes(help_deb(lang))
    return folder
