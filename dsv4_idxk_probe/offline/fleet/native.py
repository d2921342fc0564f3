"""The native line pass (`cscan.c`), when the install could build it.

One compiled pass per chunk of a file: the line checksum, the canonical split (the line is
byte for byte what the writer's `encode_line` writes for a plain room record), the fields
the engine keeps, the digest's hash and the `pack_digest` checks of a prefill digest. It
replaces the Python scan and DuckDB's JSON ingest for the fast files: canonical room
records come back as compact columns, every other line whose checksum holds is *odd*
(the reference reads it, as on the pure-Python path). What makes a file *slow* is the
Python scan's rule, line for line (`scan.check_chunk`).

`module()` is None when the extension was not built (no C compiler at install) or when
`DSV4_IDXK_PROBE_FLEET_NATIVE=0`: then the pure-Python scan and DuckDB's ingest run.
`room_table()`, `clean_rooms()`, `clean_counts()`: the native room table (`ctable.c`), which
judges and writes clean rooms as the SQL does (`table_route` runs `diff` through it).
"""

from __future__ import annotations

import logging
import os
import zlib
from pathlib import Path

import numpy as np

from ...roomlog.reader import MAX_LINE_BYTES, TORN, is_torn_tail
from ...vocabulary import STAGES, VERDICTS
from ..printable import json_safe
from .scan import FileScan, SlowFile, line_views, open_log, refused_name

log = logging.getLogger("dsv4_idxk_probe.roomlog")

ENV = "DSV4_IDXK_PROBE_FLEET_NATIVE"

try:
    from . import cscan
except ImportError:  # not built: the pure-Python path
    cscan = None
else:
    cscan.configure(STAGES, VERDICTS, MAX_LINE_BYTES)

try:
    from . import ctable
except ImportError:  # not built
    ctable = None


def module():
    """The compiled module, or None (not built, or turned off by the environment)."""
    if os.environ.get(ENV, "").strip() in ("0", "false", "no", "off"):
        return None
    return cscan


def room_table():
    """An empty native room table (`ctable.c`: each key's clean-or-complex judgment, as the
    SQL classification makes it, from this pass's rows), or None where it was not built."""
    return None if ctable is None else ctable.RoomTable(STAGES.index("prefill_send"))


def clean_rooms(table, file_names: list[str]) -> list[tuple[int, bytes]]:
    """(first decode position, JSON line) of every clean key in `table`, in that order, as
    `output` writes a clean room from SQL; `file_names[fid]` is a file's name as JSON
    spells it inside a string."""
    ords, ends, text, _ = table.clean_rooms_json(tuple(STAGES), tuple(VERDICTS), tuple(file_names))
    starts = [0, *np.frombuffer(ends, np.int64).tolist()]
    return [(o, json_safe(text[starts[i]:starts[i + 1]]))
            for i, o in enumerate(np.frombuffer(ords, np.int64).tolist())]


def clean_counts(table) -> dict:
    """The clean keys' counts that `summary.merge` takes from SQL (rooms, open, live,
    duplicates of the decoded ones; records and the first one's position of all)."""
    return table.clean_counts(STAGES.index("decode_finish"), VERDICTS.index("mismatch"),
                              VERDICTS.index("not_comparable"))


def describe() -> str:
    """Which line pass `diff` takes, for its progress output."""
    if cscan is None:
        return "line pass: pure Python + DuckDB (the native module was not built)"
    if module() is None:
        return f"line pass: pure Python + DuckDB ({ENV}=0)"
    return "line pass: native (cscan)"


def scan_file(path: Path, order: int, native) -> FileScan:
    """The native pass over one file: its canonical rows (`scan.rows`) and odd line numbers
    (`scan.odd`), or `fast` False with the reason (the reference reader reads it)."""
    scan = FileScan(path, order)
    why = refused_name(path)
    if why is not None:
        scan.fast, scan.why = False, why
        return scan
    try:
        f, scan.gzip = open_log(path)
        with f:
            line = 1
            for data, final in line_views(f):
                scan.text_bytes += len(data)
                status, why, n_lines, n_valid, torn_at, cols, odd = native.scan_chunk(data, line, final)
                if status == 1:
                    return _slow(scan, why)
                if status == 2:  # the last line, without newline, fails: torn, or an error
                    if not is_torn_tail(bytes(data[torn_at:])):
                        return _slow(scan, "a line fails its checksum")
                    log.warning("%s:%d: %s", scan.path, line + n_lines - 1, TORN)
                line += n_lines
                scan.n_valid += n_valid
                if cols["room"]:
                    scan.rows.append(cols)
                if odd:
                    scan.odd.append(np.frombuffer(odd, np.int64))
    except SlowFile as exc:
        return _slow(scan, str(exc))
    except (OSError, EOFError, zlib.error) as exc:
        return _slow(scan, f"unreadable: {exc.__class__.__name__}")
    return scan


def _slow(scan: FileScan, why: str) -> FileScan:
    scan.fast, scan.why = False, why
    scan.rows, scan.odd, scan.n_valid = [], [], 0
    return scan


def rows_of(scan: FileScan) -> int:
    return sum(len(c["room"]) for c in scan.rows)
