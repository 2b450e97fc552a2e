"""Reading a corpus folder: `DIR/<lang>/**/*.{txt,jsonl}[.gz]`.

`.txt`: one document per line. `.jsonl`: one JSON object per line with a string field `text`.
Text is UTF-8, or UTF-16/UTF-32 when the file starts with that encoding's byte-order mark
(Windows "Unicode" text); line ends may be CRLF. Symlinks inside a language folder are
followed. What is skipped (and counted) versus what is an error is listed in
`SKIPPED_VS_ERRORS`, which the command-line tools print in `--help`.
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
import os
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from megatron_rembert.data.common import DataError

LANG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
DEFAULT_MAX_LINE_BYTES = 1 << 24  # 16 MiB: a whole book on one line is fine, a 1 GB blob is not

SKIPPED_VS_ERRORS = """\
skipped, counted and reported in the summary: blank lines; lines that are not valid text
(invalid UTF-8, a lone surrogate in UTF-16/32 or in a .jsonl "text"); lines longer than
--max-line-bytes; .jsonl lines that are not JSON objects with a string field "text"; empty
files; files of unknown type (not .txt/.jsonl, optionally .gz) and files directly in the corpus
folder; language folders that hold no text; symlinks that dangle or lead to a folder or file
already read (a loop), listed by name. Files in UTF-16/UTF-32 with a byte-order mark are
decoded; file names that are not UTF-8 are shown with \\x escapes.
errors (exit code 2, message names the path): a missing or unreadable corpus folder, an
unreadable or corrupt (e.g. truncated .gz) file, a language folder name that is not
[A-Za-z0-9_-], a corpus in which no language has any text."""


@dataclass
class SkipStats:
    """Counts of skipped input; `unknown_files`/`empty_languages` keep names for the report."""

    blank_lines: int = 0
    bad_utf8_lines: int = 0
    long_lines: int = 0
    bad_json_lines: int = 0
    empty_files: int = 0
    unknown_files: list[str] = field(default_factory=list)
    empty_languages: list[str] = field(default_factory=list)
    skipped_links: list[str] = field(default_factory=list)  # dangling, or a loop

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SkipStats:
        return cls(**d)

    def add(self, other: SkipStats) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)

    def report(self) -> str:
        parts = [f"{k}={v}" for k, v in asdict(self).items() if isinstance(v, int) and v]
        for key in ("unknown_files", "skipped_links"):
            names = getattr(self, key)
            if names:
                shown = ", ".join(names[:5])
                more = len(names) - 5
                parts.append(f"{key}={len(names)} ({shown}"
                             f"{f', +{more} more' if more > 0 else ''})")
        if self.empty_languages:
            parts.append(f"languages without text: {', '.join(self.empty_languages)}")
        return "skipped: " + ("; ".join(parts) if parts else "nothing")


@dataclass(frozen=True)
class CorpusFile:
    lang: str
    path: str
    rel: str  # path relative to the corpus root, stable across machines
    kind: str  # "txt" or "jsonl"
    gz: bool
    size: int


def _file_kind(name: str) -> tuple[str | None, bool]:
    gz = name.endswith(".gz")
    base = name[:-3] if gz else name
    for kind in ("txt", "jsonl"):
        if base.endswith("." + kind):
            return kind, gz
    return None, gz


def shown_name(name: str) -> str:
    """A file name as printable, JSON-safe text: bytes that are not UTF-8 (which Python keeps
    as lone surrogates) become \\xNN escapes. Valid names are unchanged."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _language_files(lang_dir: Path, root: Path, stats: SkipStats) -> list[Path]:
    """Every file under `lang_dir`, sorted, following symlinks. A folder or file reached a
    second time (a symlink loop, or two links to one place) and a dangling link are skipped
    and listed in `stats.skipped_links`."""
    top = lang_dir.stat()
    seen = {(top.st_dev, top.st_ino)}
    files: list[Path] = []
    stack = [lang_dir]
    while stack:
        d = stack.pop()
        try:
            entries = sorted(d.iterdir())
        except OSError as e:
            raise DataError(f"cannot read language folder {d}: {e}") from e
        for p in entries:
            try:
                st = p.stat()  # follows the link
            except OSError:  # a dangling link (or one that loops on itself)
                stats.skipped_links.append(shown_name(p.relative_to(root).as_posix()))
                continue
            if (st.st_dev, st.st_ino) in seen:
                stats.skipped_links.append(shown_name(p.relative_to(root).as_posix()))
                continue
            seen.add((st.st_dev, st.st_ino))
            if p.is_dir():
                stack.append(p)
            elif p.is_file():
                files.append(p)
    return sorted(files)


def discover_corpus(
    root: str | os.PathLike, languages: list[str] | None = None
) -> tuple[dict[str, list[CorpusFile]], SkipStats]:
    """Map language -> its text files (sorted by relative path) plus skip counts.

    Languages without any non-empty text file are left out and listed in
    `stats.empty_languages`. `languages` restricts (and must name existing folders)."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"corpus folder {root} does not exist or is not a folder; pass the folder "
                        "holding one sub-folder per language (DIR/<lang>/*.txt).")
    stats = SkipStats()
    try:
        entries = sorted(root.iterdir())
    except OSError as e:
        raise DataError(f"cannot read corpus folder {root}: {e}") from e
    lang_dirs = {}
    for p in entries:
        if p.is_dir():
            if not LANG_RE.match(p.name):
                raise DataError(f"language folder {shown_name(str(p))} has a name that is not "
                                "[A-Za-z0-9_-]; rename it to a language code such as 'en' or "
                                "'zh_hans'.")
            lang_dirs[p.name] = p
        else:
            stats.unknown_files.append(shown_name(p.name))
    if languages:
        missing = [lang for lang in languages if lang not in lang_dirs]
        if missing:
            raise DataError(f"--languages names {missing}, which have no folder in {root}.")
        lang_dirs = {k: v for k, v in lang_dirs.items() if k in languages}
    out: dict[str, list[CorpusFile]] = {}
    for lang, d in lang_dirs.items():
        files = []
        for p in _language_files(d, root, stats):
            rel = shown_name(p.relative_to(root).as_posix())
            kind, gz = _file_kind(p.name)
            if kind is None:
                stats.unknown_files.append(rel)
                continue
            size = p.stat().st_size
            if size == 0:
                stats.empty_files += 1
                continue
            files.append(CorpusFile(lang, str(p), rel, kind, gz, size))
        if files:
            out[lang] = files
        else:
            stats.empty_languages.append(lang)
    if not out:
        raise DataError(f"no language folder in {root} holds a non-empty .txt/.jsonl(.gz) file; "
                        "expected DIR/<lang>/*.txt (one document per line).")
    return out, stats


# Byte-order marks of the encodings decoded besides UTF-8, longest first (UTF-32-LE's mark
# starts with UTF-16-LE's). The codecs named here read the mark and the byte order from it.
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def _not_text(err: UnicodeDecodeError) -> tuple[str, int]:
    # A lone surrogate or an odd trailing byte: replaced by a lone surrogate, which makes the
    # line fail UTF-8 decoding below, so it is skipped and counted like any other bad line.
    return "\udcff", err.end


codecs.register_error("megatron_rembert.not_text", _not_text)


class _Utf8Reader:
    """A UTF-16/UTF-32 stream read as UTF-8 bytes, CRLF and CR turned into LF."""

    def __init__(self, f, encoding: str):
        self.text = io.TextIOWrapper(f, encoding=encoding, errors="megatron_rembert.not_text",
                                     newline=None)

    def read(self, n: int) -> bytes:
        return self.text.read(n).encode("utf-8", "surrogatepass")


def _byte_order_mark_encoding(f) -> str | None:
    head = f.peek(4)[:4]
    return next((enc for bom, enc in _BOMS if head.startswith(bom)), None)


DEFAULT_BLOCK_BYTES = 1 << 20  # 1 MiB of text: one preprocessing task


class LineBlock(NamedTuple):
    """Consecutive lines of one file: `data` holds `n_lines` lines from line `first_line` on,
    each ending in b"\n" (also the file's last one). A line longer than the limit is cut to
    limit + 1 bytes, so it stays recognisable as too long without being held whole."""

    first_line: int
    n_lines: int
    data: bytes


def _raw_blocks(read, max_line_bytes: int, block_bytes: int) -> Iterator[tuple[bytes, int]]:
    """(data, number of lines) of consecutive whole lines, cut at line ends once a block holds
    `block_bytes` (read in quarters of that, so a block holds at most about 1.25 times it,
    plus the line that crosses the mark). Where blocks fall depends only on the text, so a
    resumed run (which reads from the start of the file again) makes the same blocks as an
    uninterrupted one."""
    # line: the unfinished one, kept to limit bytes (longer than that: too long already)
    block, n, line, limit = bytearray(), 0, bytearray(), max_line_bytes + 1
    while chunk := read(max(1, block_bytes // 4)):
        first_end = chunk.find(b"\n")
        if len(line) < limit:
            line += chunk if first_end < 0 else chunk[:first_end]
            del line[limit:]
        if first_end < 0:  # the unfinished line goes on through the whole chunk
            continue
        block += line
        block += b"\n"
        last_end = chunk.rfind(b"\n")
        # whole lines (the parser finds long ones), through a view: no copy of the slice
        block += memoryview(chunk)[first_end + 1: last_end + 1]
        n += 1 + chunk.count(b"\n", first_end + 1, last_end + 1)
        line = bytearray(chunk[last_end + 1: last_end + 1 + limit])
        if len(block) >= block_bytes:
            yield bytes(block), n
            block, n = bytearray(), 0
    if line:  # the last line has no line end
        block += line
        block += b"\n"
        n += 1
    if n:
        yield bytes(block), n


def iter_line_blocks(
    cf: CorpusFile,
    start_line: int = 0,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    on_progress: Callable[[int], None] | None = None,
) -> Iterator[LineBlock]:
    """The lines of one file from `start_line` on, in blocks of about `block_bytes` (the same
    blocks whatever `start_line`, apart from the first one's cut). Only the bytes are read here;
    `documents_in_block` applies the rules on what is a document. `on_progress(bytes)`
    receives the position in the (possibly compressed) file."""
    try:
        raw = open(cf.path, "rb")  # noqa: SIM115 - closed in finally, wrapped by gzip below
    except OSError as e:
        raise DataError(f"cannot open {cf.path}: {e}") from e
    try:
        f = gzip.GzipFile(fileobj=raw, mode="rb") if cf.gz else raw
        encoding = _byte_order_mark_encoding(f)
        read = f.read if encoding is None else _Utf8Reader(f, encoding).read
        first = 0
        for data, n in _raw_blocks(read, max_line_bytes, block_bytes):
            if on_progress is not None:
                on_progress(raw.tell())
            if first + n > start_line:
                if first < start_line:  # resuming inside this block: drop its earlier lines
                    cut = 0
                    for _ in range(start_line - first):
                        cut = data.index(b"\n", cut) + 1
                    data, n, first = data[cut:], n - (start_line - first), start_line
                yield LineBlock(first, n, data)
            first += n
        if on_progress is not None:
            on_progress(raw.tell())
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"cannot read {cf.path} (corrupt or truncated file?): {e}; "
                        "re-download it or move it out of the corpus folder.") from e
    finally:
        raw.close()


def _clean(text: str) -> str:
    """A line's document text: byte-order marks at its start and surrounding blanks removed."""
    return text.lstrip("\ufeff").strip()


def _json_text(line: str, stats: SkipStats) -> str | None:
    """The text of one JSON Lines document, or None (counted) when the line has none."""
    if not line.strip():
        stats.blank_lines += 1
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        obj = None
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        stats.bad_json_lines += 1
        return None
    try:  # JSON may escape a lone surrogate ("\ud800"), which is no text
        obj["text"].encode("utf-8")
    except UnicodeEncodeError:
        stats.bad_utf8_lines += 1
        return None
    return obj["text"]


def _decoded_lines(block: LineBlock, max_line_bytes: int) -> list[str] | None:
    """The block's lines decoded in one call, or None if some line is too long or not UTF-8."""
    if len(block.data) > max_line_bytes:  # else no line can be too long
        if max(map(len, block.data.split(b"\n"))) > max_line_bytes:
            return None
    try:
        return block.data[:-1].decode("utf-8").split("\n")
    except UnicodeDecodeError:
        return None


def documents_in_block(block: LineBlock, kind: str, max_line_bytes: int, stats: SkipStats
                       ) -> tuple[list[int], list[str]]:
    """(line numbers, texts) of the documents in `block` of a `kind` ("txt" or "jsonl") file,
    counting what is skipped into `stats`."""
    first = block.first_line
    decoded = _decoded_lines(block, max_line_bytes)  # the common case
    if decoded is not None and kind == "txt":
        # C loops (map, all) over the lines: a Python loop per line costs as much as a tenth
        # of the tokenisation.
        if b"\xef\xbb\xbf" in block.data:  # U+FEFF, a byte-order mark, somewhere
            decoded = [t.lstrip("\ufeff") for t in decoded]
        stripped = list(map(str.strip, decoded))  # = map(_clean, ...)
        if all(stripped):
            return list(range(first, first + len(stripped))), stripped
        numbers = [n for n, t in enumerate(stripped, first) if t]
        texts = [t for t in stripped if t]
        stats.blank_lines += len(stripped) - len(texts)
        return numbers, texts
    numbers, texts = [], []
    lines = decoded if decoded is not None else block.data.split(b"\n")[:-1]
    for n, line in enumerate(lines, first):
        if decoded is None:  # bytes: check and decode each line
            if len(line) > max_line_bytes:
                stats.long_lines += 1
                continue
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError:
                stats.bad_utf8_lines += 1
                continue
        text = _json_text(line, stats) if kind == "jsonl" else line
        if text is None:
            continue
        text = _clean(text)
        if not text:
            stats.blank_lines += 1
            continue
        numbers.append(n)
        texts.append(text)
    return numbers, texts


def iter_documents(
    cf: CorpusFile,
    stats: SkipStats,
    start_line: int = 0,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    on_progress: Callable[[int], None] | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> Iterator[tuple[int, str]]:
    """Yield (line number, document text) from one file, counting skips into `stats`.

    Lines before `start_line` are read but neither returned nor counted (used on resume)."""
    for block in iter_line_blocks(cf, start_line, max_line_bytes, block_bytes, on_progress):
        yield from zip(*documents_in_block(block, cf.kind, max_line_bytes, stats), strict=True)


def chunk_text(text: str, max_chars: int) -> list[str]:
    """Split a document into pieces of at most `max_chars`, at a space where there is one
    (scripts without spaces, e.g. Chinese, are cut at the limit)."""
    out = []
    while len(text) > max_chars:
        cut = text.rfind(" ", max_chars // 2, max_chars)
        cut = max_chars if cut < 0 else cut
        out.append(text[:cut].strip())
        text = text[cut:].strip()
    if text:
        out.append(text)
    return [t for t in out if t]
