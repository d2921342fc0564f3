"""Read room logs back: files, directories or globs, plain or gzipped.

Every line comes out as an `Entry` with its file and 1-based line number,
either parsed (`record`) or rejected (`error`), so callers can report
``file:line: why`` and carry on. Opening problems (a missing path, a glob
that matches nothing, an unreadable or truncated .gz) are `InputError`s or
error entries, never tracebacks.

A torn final line (the writer stopped mid-write: no newline at the end of
the file, starts like a line, its checksum member cut off) is not an error: it is
skipped, logged and handed to the caller's `torn` list, so a crash never
makes a log set bad input; the same bytes anywhere else are an error entry.

Memory is bounded on any input, compressed or not: a line longer than
`MAX_LINE_BYTES` is skipped in pieces (an error entry names it), and a file
stops after `MAX_FILE_BYTES` of (decompressed) text.

A request id (`rid`) longer than `ridcap.MAX_RID_CHARS` is cut when read, with a
marker, and logged (WARNING, once per file); a line over `MAX_LINE_BYTES` only
because of its rid is read in bounded pieces and kept, its rid cut, so the room
is still judged (`ridcap.squeeze_long_line`).
"""

from __future__ import annotations

import glob
import gzip
import logging
import os
import re
import zlib
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

from .lineformat import LineError, decode_line
from .ridcap import MAX_RID_CHARS, cap_rid, squeeze_long_line

log = logging.getLogger("dsv4_idxk_probe.roomlog")

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
    """Log files anywhere under `directory` (prefill/ and decode/ may sit side by side); a
    folder that cannot be listed is an `InputError` naming it (an unreadable subfolder raised)."""
    try:
        return sorted(p for p in directory.rglob("*") if p.is_file() and p.name.endswith(_LOG_SUFFIXES))
    except OSError as exc:
        raise InputError(f"{directory}: cannot list {exc.filename or directory}: {exc.strerror or exc}") from None


def _open(path: Path):
    """Binary line source; gzip is recognised by its magic bytes, not its name."""
    f = open(path, "rb")
    if f.read(2) == _GZIP_MAGIC:
        f.close()
        return gzip.open(path, "rb")
    f.seek(0)
    return f


def _lines(f, max_line: int) -> Iterator[tuple[bytes | None, int, int | None]]:
    """(line, bytes consumed, raw length of a rid cut to fit); line None for one over
    `max_line`, whose rest is read past in bounded pieces (kept, its rid cut, when only
    its rid makes it that long: `ridcap.squeeze_long_line`)."""
    while True:
        raw = f.readline(max_line + 1)
        if not raw:
            return
        if len(raw) <= max_line or raw.endswith(b"\n"):
            yield raw, len(raw), None
            continue
        yield squeeze_long_line(f, raw, max_line)


TORN = "torn final line (no newline at the end, no checksum: the writer stopped mid-write); skipped"


_WHOLE_TAIL = re.compile(rb',"h":"[0-9a-f]{16}"\}\r?$')


def is_torn_tail(raw: bytes) -> bool:
    """A file's last line cut by a crash: no newline (so nothing follows it), it starts like
    a line and its checksum member is cut off; the caller has seen it fail. A line that
    is whole but fails its checksum (edited, corrupted) stays an error."""
    return not raw.endswith(b"\n") and raw.startswith(b"{") and _WHOLE_TAIL.search(raw) is None


def read_file(path: Path, *, max_line: int = MAX_LINE_BYTES, max_file: int = MAX_FILE_BYTES,
              torn: list | None = None) -> Iterator[Entry]:
    """Entries of one file; unreadable parts become error entries naming the line.

    A torn final line is not yielded: it is logged (WARNING) and appended to `torn`
    (an Entry whose error is `TORN`) when the caller passes a list to count it in.
    """
    name = str(path)
    line_no = 0
    total = 0
    rid_cut_logged = False
    try:
        with _open(path) as f:
            for raw, size, rid_bytes in _lines(f, max_line):
                line_no += 1
                total += size
                if total > max_file:
                    yield Entry(name, line_no, None, f"file is over {max_file:,} bytes; the rest is not read")
                    return
                if raw is None:
                    yield Entry(name, line_no, None, f"line is over {max_line:,} bytes (skipped unread)")
                    continue
                try:
                    record = decode_line(raw)
                except LineError as exc:
                    if is_torn_tail(raw):
                        log.warning("%s:%d: %s", name, line_no, TORN)
                        if torn is not None:
                            torn.append(Entry(name, line_no, None, TORN))
                        continue
                    yield Entry(name, line_no, None, "empty line" if raw.isspace() else str(exc))
                    continue
                rid = record.get("rid")
                if (rid_bytes is not None or (type(rid) is str and len(rid) > MAX_RID_CHARS)) and cap_rid(record, rid_bytes):
                    if not rid_cut_logged:
                        rid_cut_logged = True
                        log.warning("%s:%d: rid cut to %d characters (%s); the room is kept, and any later "
                                    "long rid of this file cut alike", name, line_no, MAX_RID_CHARS, record["rid"][-60:])
                yield Entry(name, line_no, record)
    except (OSError, EOFError, zlib.error) as exc:
        # A truncated gzip (crash while compressing elsewhere) ends here after its good lines.
        yield Entry(name, line_no + 1, None, f"cannot read further: {exc.__class__.__name__}: {exc}")


def read_entries(paths: Iterable[Path], *, torn: list | None = None) -> Iterator[Entry]:
    for path in paths:
        yield from read_file(path, torn=torn)
