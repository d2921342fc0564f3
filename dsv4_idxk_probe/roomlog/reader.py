"""Read room logs back: files, directories or globs, plain or gzipped.

Every line comes out as an `Entry` with its file and 1-based line number,
either parsed (`record`) or rejected (`error`), so callers can report
``file:line: why`` and carry on. Opening problems (a missing path, a glob
that matches nothing, an unreadable or truncated .gz) are `InputError`s or
error entries, never tracebacks.

Memory is bounded on any input, compressed or not: a line longer than
`MAX_LINE_BYTES` is skipped in pieces (an error entry names it), and a file
stops after `MAX_FILE_BYTES` of (decompressed) text.
"""

from __future__ import annotations

import glob
import gzip
import os
import zlib
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

from .lineformat import LineError, decode_line

_GZIP_MAGIC = b"\x1f\x8b"
MAX_LINE_BYTES = 8 << 20  # a room of 1M tokens is ~0.3 MB; 8 MB is no record the probe writes
MAX_FILE_BYTES = 1 << 36  # the largest roomlog.max_bytes a config accepts
_SKIP_CHUNK = 1 << 20
_LOG_SUFFIXES = (".jsonl", ".jsonl.gz")
_GLOB_CHARS = set("*?[")


class InputError(ValueError):
    """A log argument that names nothing readable; the message names it."""


class Entry(NamedTuple):
    """One line: parsed (`record`) or rejected (`error`). A tuple: millions are made."""

    file: str
    line: int
    record: dict | None
    error: str | None = None

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def expand_inputs(args: Iterable[str]) -> list[Path]:
    """Files named by `args` (files, directories searched for *.jsonl[.gz], globs), each once, in order.

    Rotated files sort by name, which is their sequence number, so a
    directory reads oldest first.
    """
    out: list[Path] = []
    seen: set[str] = set()

    def add(path: Path) -> None:
        key = os.path.realpath(path)
        if key not in seen:
            seen.add(key)
            out.append(path)

    for arg in args:
        if _GLOB_CHARS & set(arg):
            matches = sorted(glob.glob(arg, recursive=True))
            if not matches:
                raise InputError(f"{arg}: glob matches no file")
            for match in matches:
                path = Path(match)
                if path.is_dir():
                    for f in _log_files_in(path):
                        add(f)
                elif path.is_file():
                    add(path)
        else:
            path = Path(arg)
            if path.is_dir():
                files = _log_files_in(path)
                if not files:
                    raise InputError(f"{arg}: directory holds no *.jsonl or *.jsonl.gz file")
                for f in files:
                    add(f)
            elif path.is_file():
                add(path)
            elif path.exists():
                raise InputError(f"{arg}: not a regular file or directory")
            else:
                raise InputError(f"{arg}: no such file or directory")
    return out


def _log_files_in(directory: Path) -> list[Path]:
    """Log files anywhere under `directory` (prefill/ and decode/ may sit side by side)."""
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name.endswith(_LOG_SUFFIXES))


def _open(path: Path):
    """Binary line source; gzip is recognised by its magic bytes, not its name."""
    f = open(path, "rb")
    if f.read(2) == _GZIP_MAGIC:
        f.close()
        return gzip.open(path, "rb")
    f.seek(0)
    return f


def _lines(f, max_line: int) -> Iterator[tuple[bytes | None, int]]:
    """(line, bytes consumed); line None for one over `max_line`, whose rest is skipped unread."""
    while True:
        raw = f.readline(max_line + 1)
        if not raw:
            return
        if len(raw) <= max_line or raw.endswith(b"\n"):
            yield raw, len(raw)
            continue
        consumed = len(raw)
        while True:  # drop the rest of the line in bounded pieces
            piece = f.readline(_SKIP_CHUNK)
            consumed += len(piece)
            if not piece or piece.endswith(b"\n"):
                break
        yield None, consumed


def read_file(path: Path, *, max_line: int = MAX_LINE_BYTES, max_file: int = MAX_FILE_BYTES) -> Iterator[Entry]:
    """Entries of one file; unreadable parts become error entries naming the line."""
    name = str(path)
    line_no = 0
    total = 0
    try:
        with _open(path) as f:
            for raw, size in _lines(f, max_line):
                line_no += 1
                total += size
                if total > max_file:
                    yield Entry(name, line_no, None, f"file is over {max_file:,} bytes; the rest is not read")
                    return
                if raw is None:
                    yield Entry(name, line_no, None, f"line is over {max_line:,} bytes (skipped unread)")
                    continue
                try:
                    yield Entry(name, line_no, decode_line(raw))
                except LineError as exc:
                    yield Entry(name, line_no, None, "empty line" if raw.isspace() else str(exc))
    except (OSError, EOFError, zlib.error) as exc:
        # A truncated gzip (crash while compressing elsewhere) ends here after its good lines.
        yield Entry(name, line_no + 1, None, f"cannot read further: {exc.__class__.__name__}: {exc}")


def read_entries(paths: Iterable[Path]) -> Iterator[Entry]:
    for path in paths:
        yield from read_file(path)
