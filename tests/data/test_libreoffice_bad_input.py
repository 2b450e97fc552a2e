"""rembert-libreoffice-corpus on bad input: one `error:` line (exit 2) naming the package,
flag or folder, the previous output kept; or skipped and counted."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from megatron_rembert.data.common import DataError
from megatron_rembert.prep import commands
from megatron_rembert.prep.help_pages import read_help_pages
from megatron_rembert.prep.libreoffice import LibreOfficeConfig, build_libreoffice_corpus
from tests.data.libreoffice_debs import deb, deb_name, tar, write_debs


@pytest.fixture(scope="module")
def debs(tmp_path_factory) -> Path:
    return write_debs(tmp_path_factory.mktemp("debs"))


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
             "usr/share/libreoffice/help/de-AT/text/shared/b.html": good}
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
        build_libreoffice_corpus(LibreOfficeConfig(str(debs), str(tmp_path / "o")))
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


