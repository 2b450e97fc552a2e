"""Reading LibreOffice's help pages out of Debian's `libreoffice-help-<lang>` packages.

A `.deb` is an `ar` archive whose member `data.tar.xz` (or `.gz`) holds the pages under
`usr/share/libreoffice/help/<folder>/text/<module>/**/*.html`, `<folder>` being the package's
language code in LibreOffice's spelling (`en-US` for `en-us`, `pt-BR` for `pt-br`). Everything
is read in memory: no member is ever extracted, so no name inside an archive can make us write
anywhere. A page's paragraphs are its `<p id="par_id...">` elements, as plain text (tags
stripped, entities unescaped, whitespace collapsed); the ids are the same in every language.

A damaged package (not an `ar` archive, truncated, a corrupt or missing data member) is an
error naming the file; a damaged page (not UTF-8, a paragraph that never closes) is skipped
and counted in `PageStats.skipped`.
"""

from __future__ import annotations

import html
import io
import lzma
import re
import tarfile
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rembert.data.common import DataError

AR_MAGIC = b"!<arch>\n"
AR_HEADER = 60  # name 16, mtime 12, uid 6, gid 6, mode 8, size 10, magic "`\n"
# A data member that expands past this is not a help package (the real ones are ~30 MB).
MAX_UNPACKED_BYTES = 1 << 30
HELP_ROOT = "usr/share/libreoffice/help/"
PACKAGE_PREFIX = "libreoffice-help-"

_OPEN_P = re.compile(r"<p\b[^>]*>", re.IGNORECASE)
_PAR_ID = re.compile(r"""\bid\s*=\s*["'](par_id[^"'\s]*)["']""")
_END_OR_NEXT_P = re.compile(r"</p\s*>|<p\b", re.IGNORECASE)
_BREAK = re.compile(r"<br\b[^>]*>", re.IGNORECASE)
_TAG_OR_COMMENT = re.compile(r"<!--.*?-->|<[^>]*>", re.DOTALL)


class MalformedPage(ValueError):
    """A page whose paragraphs cannot be told apart; the page is skipped and counted."""


@dataclass
class PageStats:
    """What reading one package found: pages read, paragraphs kept in them, paragraphs dropped
    for a repeated id (`repeated_ids`, see `unique_paragraphs`), and members skipped by reason
    (`malformed: ...` pages, `link` members, `no module` pages directly under text/, `odd name`
    paths with '..' or empty parts)."""

    pages: int = 0
    paragraphs: int = 0
    repeated_ids: int = 0
    skipped: Counter = field(default_factory=Counter)


@dataclass(frozen=True)
class Page:
    """One help page: `module` is the first folder under text/; `paragraphs` are (par id,
    text) in page order, each id once."""

    module: str
    paragraphs: list[tuple[str, str]]


def package_code(filename: str) -> str | None:
    """`libreoffice-help-pt-br_4%3a7.4.7-1_all.deb` -> `pt-br`; None for any other name."""
    if not (filename.startswith(PACKAGE_PREFIX) and filename.endswith(".deb")):
        return None
    code = filename[len(PACKAGE_PREFIX):-len(".deb")].split("_", 1)[0]
    return code if re.fullmatch(r"[a-z0-9][a-z0-9-]*", code) else None


def clean_text(inner_html: str) -> str:
    """A paragraph's markup -> plain text: a line break is a space, other tags and comments go,
    entities are unescaped (after the tags, so `&lt;b&gt;` stays text), whitespace collapses."""
    text = _TAG_OR_COMMENT.sub("", _BREAK.sub(" ", inner_html))
    return " ".join(html.unescape(text).split())


def page_paragraphs(page: str) -> list[tuple[str, str]]:
    """(par id, text) of every `<p id="par_id...">` of an HTML page, in page order.

    Raises MalformedPage when a paragraph is not closed before the next `<p` or the end."""
    out = []
    for opening in _OPEN_P.finditer(page):
        par_id = _PAR_ID.search(opening.group(0))
        if par_id is None:
            continue
        end = _END_OR_NEXT_P.search(page, opening.end())
        if end is None or not end.group(0).startswith("</"):
            raise MalformedPage(f"paragraph {par_id.group(1)} is not closed")
        out.append((par_id.group(1), clean_text(page[opening.end():end.start()])))
    return out


def unique_paragraphs(paragraphs: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], int]:
    """Each id once, and the number of paragraphs dropped. A page repeats an id when it embeds
    a section twice: with the same text, the first occurrence stays; with different texts
    the id is ambiguous and all its occurrences go (translated pages may list them in another
    order, so the n-th occurrence need not match English's n-th)."""
    texts: dict[str, set[str]] = {}
    for par_id, text in paragraphs:
        texts.setdefault(par_id, set()).add(text)
    out, seen = [], set()
    for par_id, text in paragraphs:
        if len(texts[par_id]) == 1 and par_id not in seen:
            seen.add(par_id)
            out.append((par_id, text))
    return out, len(paragraphs) - len(out)


def _ar_members(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (offset, size) of every member of the ar archive `path`, checked to fit."""
    size = path.stat().st_size
    members = {}
    with open(path, "rb") as f:
        if f.read(len(AR_MAGIC)) != AR_MAGIC:
            raise DataError(f"{path}: not a .deb (no ar archive header); download it again "
                            "with apt-get download")
        pos = len(AR_MAGIC)
        while pos < size:
            header = f.read(AR_HEADER)
            fields = header[48:58].strip()
            if len(header) < AR_HEADER or header[58:60] != b"`\n" or not fields.isdigit():
                raise DataError(f"{path}: damaged .deb (bad ar member header at byte {pos}); "
                                "download it again with apt-get download")
            name = header[:16].decode("ascii", "replace").strip().rstrip("/")
            start, length = pos + AR_HEADER, int(fields)
            if start + length > size:
                raise DataError(f"{path}: truncated .deb (member {name} needs {length} bytes, "
                                f"{size - start} left); download it again with apt-get download")
            members[name] = (start, length)
            pos = start + length + (length & 1)  # members are padded to an even offset
            f.seek(pos)
    return members


def check_package(path: Path) -> tuple[str, int, int]:
    """(name, offset, size) of the package's data member (data.tar.xz or .gz), after checking
    that `path` is a whole ar archive that has one. Cheap: reads the headers only."""
    try:
        members = _ar_members(path)
    except OSError as err:  # a read, not a write: bad input, not a failing disk
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from err
    data = sorted(n for n in members if n.startswith("data.tar"))
    if not data:
        raise DataError(f"{path}: a .deb without a data.tar member (has {sorted(members)})")
    if data[0] not in ("data.tar.xz", "data.tar.gz"):
        raise DataError(f"{path}: data member {data[0]} is not supported (only data.tar.xz "
                        "and data.tar.gz, which Debian's packages use)")
    return (data[0], *members[data[0]])


def _unpack(path: Path, member: str, packed: bytes) -> bytes:
    """Decompress a data member, bounded by MAX_UNPACKED_BYTES, refusing a truncated one."""
    d = lzma.LZMADecompressor() if member.endswith(".xz") else zlib.decompressobj(wbits=31)
    try:
        raw = d.decompress(packed, MAX_UNPACKED_BYTES + 1)
        complete = d.eof
    except (lzma.LZMAError, zlib.error) as err:
        raise DataError(f"{path}: {member} is damaged ({err}); download it again") from err
    if len(raw) > MAX_UNPACKED_BYTES:
        raise DataError(f"{path}: {member} unpacks to more than {MAX_UNPACKED_BYTES >> 20} MiB; "
                        "not a help package")
    if not complete:
        raise DataError(f"{path}: {member} is truncated; download it again")
    return raw


def read_help_pages(path: Path, code: str) -> tuple[dict[str, Page], PageStats]:
    """The help pages of the package `path` for language `code`: {path under text/: Page},
    and what was read or skipped. Raises DataError naming `path` if the package is damaged."""
    member, offset, length = check_package(path)
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            packed = f.read(length)
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from err
    raw = _unpack(path, member, packed)
    pages, stats = {}, PageStats()
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            for info in tar:
                rel = _text_path(info.name, code)
                if rel is None:
                    continue
                reason = _skip_reason(info, rel)
                if reason is None:
                    try:
                        paragraphs = page_paragraphs(tar.extractfile(info).read().decode("utf-8"))
                    except UnicodeDecodeError:
                        reason = "malformed: not UTF-8"
                    except MalformedPage:
                        reason = "malformed: unclosed paragraph"
                if reason is not None:
                    stats.skipped[reason] += 1
                    continue
                paragraphs, repeated = unique_paragraphs(paragraphs)
                pages[rel] = Page(rel.split("/", 1)[0], paragraphs)
                stats.pages += 1
                stats.paragraphs += len(paragraphs)
                stats.repeated_ids += repeated
    except (tarfile.TarError, EOFError) as err:
        raise DataError(f"{path}: {member} holds a damaged tar archive ({err}); download it "
                        "again") from err
    return pages, stats


def _text_path(name: str, code: str) -> str | None:
    """`./usr/share/libreoffice/help/<Code>/text/<rest>.html` -> `<rest>.html`, else None."""
    name = name[2:] if name.startswith("./") else name
    if not (name.startswith(HELP_ROOT) and name.endswith(".html")):
        return None
    folder, _, rest = name[len(HELP_ROOT):].partition("/")
    if folder.lower() != code or not rest.startswith("text/"):
        return None
    return rest[len("text/"):]


def _skip_reason(info: tarfile.TarInfo, rel: str) -> str | None:
    if not info.isfile():
        return "link" if info.issym() or info.islnk() else "not a file"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "odd name"
    if "/" not in rel:
        return "no module"
    return None
