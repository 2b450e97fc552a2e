"""rembert-libreoffice-corpus on .deb packages built here: an English pivot and two languages
(de with untranslated paragraphs and its pages in another order, pt-br with a malformed page,
an extra paragraph and a broken embed), inline markup, entities, ids repeated in a page (with
the same text: kept once; with other text: ambiguous, dropped).

Expected values come from the fixture's plain texts (`SPEC`) and the documented split rule
(sha256 of "eval\\n<seed>\\n<page>"), never from the code under test."""

from __future__ import annotations

import gzip
import hashlib
import html
import io
import json
import lzma
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from megatron_rembert.data.common import DataError
from megatron_rembert.prep import commands
from megatron_rembert.prep.corpus import SkipStats, discover_corpus, iter_documents
from megatron_rembert.prep.help_pages import read_help_pages
from megatron_rembert.prep.libreoffice import LibreOfficeConfig, build_libreoffice_corpus

ROOT = Path(__file__).resolve().parents[2]
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


@pytest.fixture(scope="module")
def debs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("debs")
    for lang in ("en-us", "de", "pt-br"):
        (d / deb_name(lang)).write_bytes(help_deb(lang))
    return d


def build(debs: Path, out: Path, **kw) -> dict:
    cfg = dict(eval_fraction=FRACTION, seed=SEED, topic_min_train=MIN_TRAIN,
               topic_max_train=MAX_TRAIN)
    cfg.update(kw)
    return build_libreoffice_corpus(LibreOfficeConfig(str(debs), str(out), **cfg))


@pytest.fixture(scope="module")
def out(debs, tmp_path_factory) -> Path:
    o = tmp_path_factory.mktemp("lo") / "out"
    build(debs, o)
    return o


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_parallel_pairs_align_by_page_and_id(out):
    for lang in ("de", "pt-br"):
        want, seen_en, seen_text = [], set(), set()
        for path, rows in expected_kept(lang).items():
            if path in HELD:
                want += [{"id": f"{path}#{k}", "label": path.split("/")[0], "text": t, "en": en}
                         for k, t, en in rows]
        want.sort(key=lambda r: r["id"])
        deduped = []
        for r in want:  # a text already seen, English or not: only its first id stays
            if r["en"] not in seen_en and r["text"] not in seen_text:
                seen_en.add(r["en"])
                seen_text.add(r["text"])
                deduped.append(r)
        got = read_jsonl(out / "eval" / "parallel" / f"{lang}.jsonl")
        assert got == deduped
        assert sum(r["en"] == COMMON for r in got) == 1
        assert sum(r["text"] == "五段" for r in got) == (lang == "pt-br")
        assert not [r for r in got if "repeated id" in r["en"]]  # ambiguous: dropped
    assert not (out / "eval" / "parallel" / "en.jsonl").exists()


def test_corpus_documents_and_untranslated_dropped_from_that_language_only(out):
    for lang, code in (("en-us", "en"), ("de", "de"), ("pt-br", "pt-br")):
        kept = expected_kept(lang)  # in each language's own page order
        want = [" ".join(t for _, t, _ in kept[p]) for p in sorted(kept) if p not in HELD]
        assert (out / "corpus" / code / "help.txt").read_text(encoding="utf-8") == \
            "".join(f"{doc}\n" for doc in want)
    de = (out / "corpus" / "de" / "help.txt").read_text(encoding="utf-8")
    pt = (out / "corpus" / "pt-br" / "help.txt").read_text(encoding="utf-8")
    third = [p for p in PAGES if p not in HELD][0] + ": a third paragraph with more words."
    assert third not in de and f"[pt-br] {third}" in pt  # untranslated in de only
    assert "not found]" not in pt and "Short." not in de + pt and "五段" in pt
    assert "Tom & Jerry <b> in Zürich" in de  # markup stripped, entities unescaped


def test_no_held_out_text_reaches_the_corpus_in_any_language(out):
    corpus = "".join(p.read_text(encoding="utf-8") for p in (out / "corpus").rglob("*.txt"))
    held_texts = {t for lang in SPEC for p in HELD for _, t in SPEC[lang][p]
                  if not t.endswith(COMMON) and len(t) >= 20}  # COMMON is on every page
    assert held_texts and not [t for t in held_texts if t in corpus]


def test_topic_sets(out):
    train = read_jsonl(out / "eval" / "topic" / "train.jsonl")
    test = read_jsonl(out / "eval" / "topic" / "test.jsonl")
    page = lambda row: row["id"].split("#")[0]  # noqa: E731
    train_half = {p for p in HELD if unit("topic", SEED, p) < 0.5}
    assert {page(r) for r in train} <= train_half
    assert {page(r) for r in test} <= HELD - train_half  # disjoint by page
    assert {r["lang"] for r in train} == {"en"}
    assert {r["lang"] for r in test} == {"en", "de", "pt-br"}
    en_kept, candidates, seen = expected_kept("en-us"), {}, set()
    for p in sorted(train_half):  # English texts of train-half pages, each text once
        for _, t, _ in en_kept[p]:
            if t not in seen:
                seen.add(t)
                candidates.setdefault(p.split("/")[0], []).append(t)
    for label in MODULES:
        rows = [r for r in train if r["label"] == label]
        assert len(rows) == min(MAX_TRAIN, len(candidates[label]))
        assert {r["text"] for r in rows} <= set(candidates[label])
    assert not [r for r in test if r["text"].endswith(COMMON)]  # its English text is in train
    for r in test:
        key = r["id"].split("#")[1]
        assert (key, r["text"]) in [(k, t) for k, t, _ in expected_kept(
            {"en": "en-us"}.get(r["lang"], r["lang"]))[page(r)]]


def test_summary_counts(out, debs):
    s = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    de, pt, en = s["languages"]["de"], s["languages"]["pt-br"], s["languages"]["en"]
    n = sum(len(SPEC["en-us"][p]) for p in PAGES)
    assert en["repeated_ids"] == 2 * 4 + 4  # 4 pages of each kind: 2 ambiguous, 1 repeat
    assert en["paragraphs"] == en["aligned"] == n - 12 and en["too_short"] == len(PAGES)
    assert de["untranslated"] == len(PAGES)  # the third paragraph of every page
    assert pt["pages_skipped"] == {"malformed: unclosed paragraph": 1}
    assert pt["pages"] == len(PAGES) - 1
    assert pt["aligned"] == pt["paragraphs"] - (len(PAGES) - 1)  # the extra paragraphs
    assert pt["broken_embed"] == 4
    for lang, c in s["languages"].items():
        kept = expected_kept({"en": "en-us"}.get(lang, lang))
        assert c["kept"] == sum(map(len, kept.values()))
        assert c["eval_paragraphs"] == sum(len(kept[p]) for p in HELD if p in kept)
    assert s["inputs"]["de"] == {"package": deb_name("de"), "sha256": hashlib.sha256(
        (debs / deb_name("de")).read_bytes()).hexdigest()}
    assert s["held_out"]["sha256"] == hashlib.sha256(
        "".join(f"{p}\n" for p in sorted(HELD)).encode()).hexdigest()


def test_deterministic_and_rerun_replaces_the_output(debs, out, tmp_path):
    again = tmp_path / "again"
    build(debs, again)
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((out / f).read_bytes() == (again / f).read_bytes() for f in files)
    build(debs, again, languages=("de",))  # a rerun with fewer languages: pt-br's files go
    assert not (again / "corpus" / "pt-br").exists()
    assert not (again / "eval" / "parallel" / "pt-br.jsonl").exists()
    assert (again / "corpus" / "de" / "help.txt").read_bytes() == \
        (out / "corpus" / "de" / "help.txt").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]  # nothing else written


def test_prep_corpus_reads_the_output(out):
    files, stats = discover_corpus(out / "corpus")
    assert sorted(files) == ["de", "en", "pt-br"]
    docs = [t for _, t in iter_documents(files["de"][0], stats)]
    assert docs == (out / "corpus" / "de" / "help.txt").read_text(encoding="utf-8").splitlines()
    assert stats.to_dict() == SkipStats().to_dict()


# -- bad input: one error line (exit 2), or skipped and counted ---------------------------------
def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = commands.make_libreoffice_corpus(argv)
    except SystemExit as done:  # argparse's error: usage, then one "error:" line
        code = done.code
    out, err = capsys.readouterr()
    return code, out, err


def one_error(code: int, err: str, *words: str) -> None:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert all(w in lines[0] for w in words), lines[0]


def _copy_debs(debs: Path, to: Path, langs=("en-us", "de")) -> Path:
    to.mkdir()
    for lang in langs:
        (to / deb_name(lang)).write_bytes((debs / deb_name(lang)).read_bytes())
    return to


def _damaged(good: bytes) -> dict[str, bytes]:
    start = good.index(b"data.tar.xz")
    body = start + 60
    size = int(good[start + 48:start + 58])
    flipped = bytearray(good)
    flipped[body + size // 2] ^= 0xFF
    cut_xz = (good[:start + 48] + f"{size // 2:<10}".encode() + good[start + 58:body]
              + good[body:body + size // 2])
    return {"not an ar archive": b"<html>404 Not Found</html>",
            "truncated ar": good[:len(good) // 2],
            "corrupt xz": bytes(flipped),
            "truncated xz": cut_xz,
            "zstd member": deb(tar({}), member="data.tar.zst")}


@pytest.mark.parametrize("case", ["not an ar archive", "truncated ar", "corrupt xz",
                                  "truncated xz", "zstd member"])
def test_damaged_package_is_one_error_and_the_previous_output_stays(case, debs, tmp_path,
                                                                   capsys):
    d = _copy_debs(debs, tmp_path / "debs")
    o = tmp_path / "out"
    assert run(["--debs", str(d), "--out", str(o)], capsys)[0] == 0
    before = {p: p.read_bytes() for p in o.rglob("*") if p.is_file()}
    (d / deb_name("de")).write_bytes(_damaged((d / deb_name("de")).read_bytes())[case])
    code, _, err = run(["--debs", str(d), "--out", str(o)], capsys)
    one_error(code, err, deb_name("de"))
    assert {p: p.read_bytes() for p in o.rglob("*") if p.is_file()} == before


def test_pages_skipped_by_reason_and_a_gz_member(tmp_path):
    root = "usr/share/libreoffice/help/de/text/"  # without "./", as some tar writers do
    good = b'<p id="par_id1">Ein Absatz, gut genug.</p>'
    files = {f"{root}shared/a.html": good, f"{root}shared/latin1.html": "<p id='par_id1'>Stra\xdfe"
             "</p>".encode("latin-1"), f"{root}top.html": good, f"{root}shared/open.html":
             b'<p id="par_id1">never closed</body>', f"{root}shared/x.txt": b"not a page",
             "usr/share/libreoffice/help/de-AT/text/shared/a.html": good}
    path = tmp_path / deb_name("de")
    data = gzip.compress(tar(files, {f"{root}shared/l.html": "a.html"}), mtime=0)
    path.write_bytes(deb(data, member="data.tar.gz"))
    pages, stats = read_help_pages(path, "de")
    assert pages.keys() == {"shared/a.html"}
    assert pages["shared/a.html"].paragraphs == [("par_id1", "Ein Absatz, gut genug.")]
    assert dict(stats.skipped) == {"malformed: not UTF-8": 1, "malformed: unclosed paragraph": 1,
                                   "no module": 1, "link": 1}


def test_an_output_folder_with_other_files_is_refused_by_the_api_too(debs, tmp_path):
    (tmp_path / "o" / "corpus").mkdir(parents=True)
    (tmp_path / "o" / "corpus" / "mine.txt").write_text("keep")
    with pytest.raises(DataError, match="corpus/mine.txt"):
        build(debs, tmp_path / "o")
    assert [p.name for p in (tmp_path / "o").rglob("*")] == ["corpus", "mine.txt"]


def test_package_without_pages_is_skipped_and_listed(debs, tmp_path, capsys):
    d = _copy_debs(debs, tmp_path / "debs")
    (d / deb_name("sk")).write_bytes(deb(tar({}, {"./usr/share/libreoffice/help/sk": "cs"})))
    code, out, _ = run(["--debs", str(d), "--out", str(tmp_path / "o")], capsys)
    assert code == 0 and "no help pages" in out
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert list(s["packages_without_pages"]) == ["sk"] and "sk" not in s["languages"]
    # ... and alone besides English it leaves nothing to align: an error
    code, _, err = run(["--debs", str(d), "--out", str(tmp_path / "o2"), "--languages", "sk"],
                       capsys)
    one_error(code, err, "no paragraph")
    assert not (tmp_path / "o2").exists() or not any((tmp_path / "o2").iterdir())


def test_bad_settings_and_folders(debs, tmp_path, capsys):
    o = str(tmp_path / "o")
    one_error(*run(["--debs", str(debs), "--out", o, "--languages", "de,xx"], capsys)[::2],
              "libreoffice-help-xx", "apt-get download")
    no_en = _copy_debs(debs, tmp_path / "no_en", langs=("de",))
    one_error(*run(["--debs", str(no_en), "--out", o], capsys)[::2], "en-us")
    one_error(*run(["--debs", str(debs), "--out", str(debs / "out")], capsys)[::2], "inside")
    (tmp_path / "a_file").write_text("x")
    one_error(*run(["--debs", str(debs), "--out", str(tmp_path / "a_file")], capsys)[::2],
              "a_file")
    mine = tmp_path / "mine"
    (mine / "notes").mkdir(parents=True)
    (mine / "notes" / "todo.txt").write_text("keep me")
    one_error(*run(["--debs", str(debs), "--out", str(mine)], capsys)[::2], "notes/todo.txt")
    assert (mine / "notes" / "todo.txt").read_text() == "keep me"
    one_error(*run(["--debs", str(debs), "--out", o, "--eval-fraction", "1"], capsys)[::2],
              "--eval-fraction")
    one_error(*run(["--debs", str(tmp_path / "nowhere"), "--out", o], capsys)[::2], "nowhere")
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


@pytest.mark.multiprocess
def test_the_checkout_script_runs(debs, tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "data_tools" / "make_libreoffice_corpus.py"),
                           "--debs", str(debs), "--out", str(tmp_path / "o"),
                           "--eval-fraction", "0.5", "--seed", str(SEED)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pt-br" in done.stdout and (tmp_path / "o" / "summary.json").exists()
