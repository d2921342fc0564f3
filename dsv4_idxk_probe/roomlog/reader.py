"""Read room logs back: files, directories or globs, plain or gzipped.

Every line comes out as an `Entry` with its file and 1-based line number,
either parsed (`record`) or rejected (`error`), so callers can report
``file:line: why`` and carry on. Opening problems (a missing path, a glob
that matches nothing, an unreadable or truncated .gz) are `InputError`s or
error entries, never tracebacks.
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


def read_file(path: Path) -> Iterator[Entry]:
    """Entries of one file; unreadable parts become error entries naming the line."""
    name = str(path)
    line_no = 0
    try:
        with _open(path) as f:
            for line_no, raw in enumerate(f, 1):
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
