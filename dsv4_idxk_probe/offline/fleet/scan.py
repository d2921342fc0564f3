"""The checksum scan: every line of a file verified before DuckDB may read it.

Python, one file at a time in chunks of `CHUNK_BYTES`: the line checksum `h` (xxh64 of the
bytes before `,"h":`) of every line, with xxhash over memoryview slices and the expected
values parsed with NumPy. A file whose lines all hold (a torn final line aside, skipped
and logged as the reference reader does) is *fast*: DuckDB reads it and the scan keeps
only (line, h, length) per line, which DuckDB's rows are joined to. Any other file is
*slow*: the reference reader reads it, so its bad lines are named exactly as today.
"""

from __future__ import annotations

import gzip
import logging
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import xxhash

from ...roomlog.reader import MAX_FILE_BYTES, MAX_LINE_BYTES, TORN, is_torn_tail

log = logging.getLogger("dsv4_idxk_probe.roomlog")

CHUNK_BYTES = 64 << 20  # the scan reads a file in chunks of about this size
# the native pass's reads, at most (`line_views`): a chunk read into a buffer that stays in the
# core's cache is split and hashed from there (measured at 10^7 records: ~0.2 s less CPU of ~11,
# 65 MB less resident than reading whole 11 MB files)
VIEW_BYTES = 1 << 20
SUFFIX = b',"h":"'
SUFFIX_LEN = len(SUFFIX) + 16 + 2


@dataclass
class FileScan:
    path: Path
    order: int  # the file's rank in reading order (`join.prefill_files_first`)
    fast: bool = True
    why: str = ""
    gzip: bool = False
    h: list = field(default_factory=list)  # numpy arrays per chunk
    line: list = field(default_factory=list)
    length: list = field(default_factory=list)
    n_valid: int = 0
    text_bytes: int = 0
    name: str = ""  # what outputs call the file (its path, or the URL it was fetched from)
    rows: list = field(default_factory=list)  # the native pass: column dicts per chunk (`native.py`)
    odd: list = field(default_factory=list)  # the native pass: odd line numbers per chunk


def open_log(path: Path) -> tuple[BinaryIO, bool]:
    f = open(path, "rb")
    if f.read(2) == b"\x1f\x8b":
        f.close()
        return gzip.open(path, "rb"), True
    f.seek(0)
    return f, False


_HEXVAL = np.full(256, 255, dtype=np.uint8)
_HEXVAL[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint8)
_SUFFIX_ARR = np.frombuffer(SUFFIX, np.uint8)


def check_chunk(data: bytes, first_line: int, final: bool, scan: FileScan) -> int:
    """Verify the complete lines of `data` (which ends at a newline unless `final`);
    returns how many lines it held. Sets scan.fast False on anything the fast path
    does not take."""
    arr = np.frombuffer(data, np.uint8)
    ends = np.flatnonzero(arr == 10)
    starts = np.empty(len(ends), dtype=np.int64)
    if len(ends):
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
    torn_tail = None
    if final and (not len(ends) or ends[-1] != len(data) - 1) and len(data):
        # the file's last line has no newline: checked like the others, torn is allowed
        last_start = int(ends[-1]) + 1 if len(ends) else 0
        starts = np.append(starts, last_start)
        ends = np.append(ends, len(data))
        torn_tail = len(ends) - 1
    n = len(ends)
    if not n:
        return 0
    lengths = ends - starts
    if int(lengths.max()) > MAX_LINE_BYTES:
        scan.fast, scan.why = False, "line over the reader's bound"
        return n
    ok = lengths >= SUFFIX_LEN + 2
    if not ok.all():
        bad = np.flatnonzero(~ok)
        if not (len(bad) == 1 and bad[0] == torn_tail):
            scan.fast, scan.why = False, "short or empty line"
            return n
        lengths, starts, ends, n, torn_tail = lengths[:-1], starts[:-1], ends[:-1], n - 1, "dropped"
        if not n:
            return 1
    # the suffix ,"h":"<16 hex>"} at the end of every line
    pos = ends - SUFFIX_LEN
    suffix_ok = (arr[pos[:, None] + np.arange(len(SUFFIX))] == _SUFFIX_ARR).all(axis=1)
    suffix_ok &= (arr[ends - 2] == 0x22) & (arr[ends - 1] == 0x7D)
    hexd = _HEXVAL[arr[(ends - 18)[:, None] + np.arange(16)]]
    suffix_ok &= (hexd != 255).all(axis=1)
    want = np.zeros(n, dtype=np.uint64)
    hexd = hexd.astype(np.uint64)
    for k in range(16):
        want = (want << np.uint64(4)) | hexd[:, k]
    mv = memoryview(data)
    heads = (ends - SUFFIX_LEN).tolist()
    got = np.fromiter(map(xxhash.xxh64_intdigest, map(mv.__getitem__, map(slice, starts.tolist(), heads))),
                      dtype=np.uint64, count=n)
    valid = suffix_ok & (got == want)
    if not valid.all():
        bad = np.flatnonzero(~valid)
        if len(bad) == 1 and bad[0] == torn_tail and is_torn_tail(data[int(starts[-1]):]):
            valid[-1] = False  # a torn final line: the reference skips it too, and logs it
            log.warning("%s:%d: %s", scan.path, first_line + len(ends) - 1, TORN)
        else:
            scan.fast, scan.why = False, "a line fails its checksum"
            return n if torn_tail != "dropped" else n + 1
    keep = np.flatnonzero(valid)
    scan.h.append(want[keep])
    scan.line.append(keep.astype(np.int64) + first_line)
    scan.length.append(lengths[keep].astype(np.int64))
    scan.n_valid += len(keep)
    return n if torn_tail != "dropped" else n + 1


def refused_name(path: Path) -> str | None:
    """Why a file's name keeps it off the fast path (the reference reads it), or None."""
    name = str(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # the reference writes such a room with the stdlib's JSON
        return "file name is not UTF-8"
    return "file name" if "\x00" in name else None


class SlowFile(Exception):
    """A file the fast path does not take (the reference reader reads it); why, in words."""


def line_chunks(f):
    """A log file's text in chunks of whole lines: (data, final), the last chunk (final) holding
    any unterminated last line. Raises SlowFile past the reader's bounds (file, line)."""
    carry = b""
    total = 0
    while True:
        block = f.read(CHUNK_BYTES)
        total += len(block)
        if total > MAX_FILE_BYTES:
            raise SlowFile("file over the reader's bound")
        data = carry + block if carry else block
        if not block:
            yield data, True
            return
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            if len(data) > MAX_LINE_BYTES:
                raise SlowFile("line over the reader's bound")
            carry = data
            continue
        data, carry = data[:cut], data[cut:]
        yield data, False


_buffers = threading.local()


def line_views(f):
    """`line_chunks` read into one reusable buffer per thread (a fresh buffer per file costs a
    page fault per 4 KiB: about a third of the native pass's reading): (memoryview, final),
    valid until the next chunk. The same bounds, reads of at most `VIEW_BYTES` (smaller
    chunks, of whole lines as there), and an unterminated tail over the line bound is refused
    as soon as it is seen."""
    step = min(CHUNK_BYTES, VIEW_BYTES)
    buf = getattr(_buffers, "buf", None)
    if buf is None or len(buf) != step + MAX_LINE_BYTES + 1:
        buf = _buffers.buf = bytearray(step + MAX_LINE_BYTES + 1)
    view = memoryview(buf)
    carry = total = 0
    while True:
        n = f.readinto(view[carry:carry + step])
        total += n
        if total > MAX_FILE_BYTES:
            raise SlowFile("file over the reader's bound")
        end = carry + n
        if not n:
            yield view[:end], True
            return
        cut = buf.rfind(b"\n", 0, end) + 1
        if cut == 0:
            if end > MAX_LINE_BYTES:
                raise SlowFile("line over the reader's bound")
            carry = end
            continue
        yield view[:cut], False
        carry = end - cut
        if carry > MAX_LINE_BYTES:
            raise SlowFile("line over the reader's bound")
        view[:carry] = view[cut:end]


def scan_file(path: Path, order: int) -> FileScan:
    """Checksum every line of one file; decide whether DuckDB may read it."""
    scan = FileScan(path, order)
    why = refused_name(path)
    if why is not None:
        scan.fast, scan.why = False, why
        return scan
    try:
        f, scan.gzip = open_log(path)
        with f:
            line = 1
            for data, final in line_chunks(f):
                # A \r, a NUL or bytes that are not UTF-8 need no check here: DuckDB then reads the
                # line otherwise (or not at all), it is missing from the canonical rows, and Python reads it.
                scan.text_bytes += len(data)
                line += check_chunk(data, line, final, scan)
                if not scan.fast:
                    return scan
                if final:
                    if scan.h and len(np.unique(np.concatenate(scan.h))) != scan.n_valid:
                        # a line written twice: (file, h, length) would not name one line
                        scan.fast, scan.why = False, "a line appears twice"
                    return scan
    except SlowFile as exc:
        scan.fast, scan.why = False, str(exc)
    except (OSError, EOFError, zlib.error) as exc:
        scan.fast, scan.why = False, f"unreadable: {exc.__class__.__name__}"
    return scan
