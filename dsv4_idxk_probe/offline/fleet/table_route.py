"""`diff` through the native room table (`ctable.c`): clean keys judged and written in C,
only the complex keys' records read by the reference joiner, no DuckDB.

Fed the native pass's rows file by file in reading order, the table judges each key as
`classify` does; odd lines and slow files make their keys complex, as on the DuckDB path.
The joiner then reads every record of the complex keys (their positions come from the
table), and the table gives the counts, orders, coverage and JSON the SQL gives on the
other path; `--since/--until/--instance` select keys in the table as `filters.filter_sql`
does in SQL. Where the table cannot serve (`--per-instance`, the table turned off, or past
its memory budget) the DuckDB path runs instead.
"""

from __future__ import annotations

import math
import os
import re
from contextlib import closing
from pathlib import Path
from typing import Iterator

import numpy as np

from ...roomlog.lineformat import LineError
from ...roomlog.reader import read_file
from ...vocabulary import STAGES, VERDICTS
from ..diff_output import json_bytes
from ..printable import json_safe
from ..results import RoomResult, StageResult
from . import native as native_pass
from .filters import Filters
from .ingest import lines_of, note_record, read_line
from .positions import LINE_BITS, LINE_MASK, position

ENV = "DSV4_IDXK_PROBE_FLEET_TABLE"
MAX_STEPS = 4096  # distinct decode (stage, step) a clean room may have; a room with more goes to the joiner
JSON_BLOCK = 50_000  # clean rooms' JSON made per call (a block, not the whole document)
PREFILL_ONLY_REASON = "prefill sent it; no decode record in these logs"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


class OverBudget(Exception):
    """The table outgrew its memory budget: the DuckDB path starts over."""


def why_not(native, filters, per_instance: bool) -> str | None:
    """Why the room table cannot judge this run (None: it can)."""
    if native is None:
        return "the native line pass is off"
    if native_pass.ctable is None:
        return "the native room table was not built"
    if os.environ.get(ENV, "").strip() in ("0", "false", "no", "off"):
        return f"{ENV}=0"
    if per_instance:
        return "--per-instance is counted in SQL"
    return None


def budget_bytes(memory_limit: str) -> int:
    """The table's memory budget: half again `--memory-limit` (DuckDB's spelling: 1GB,
    512MiB, ...), since no DuckDB runs beside it (the DuckDB route peaks at about the limit
    plus ~0.2 GB of Python); 1.5 GiB when the limit cannot be read."""
    size = size_bytes(memory_limit)
    return 3 << 29 if size is None else size * 3 // 2


def size_bytes(text: str) -> int | None:
    """Bytes of a size in DuckDB's spelling (1GB, 512MiB, 4096), None when it is not one."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?i?b?)\s*", str(text).lower())
    if not m or m.group(2) not in _UNITS:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def resident_bytes() -> int | None:
    """This process's resident memory (Linux's /proc/self/statm), None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def held_bytes(table, resident_at_start: int | None) -> int:
    """What the table costs the process: its own count (`nbytes`), or the growth of the
    resident memory since it began where that is more (the scan's own ~70 MB, memory the
    allocator keeps: the budget bounds the process, not only the table)."""
    now = resident_bytes() if resident_at_start is not None else None
    return max(table.nbytes, 0 if now is None else now - resident_at_start)


def new_table():
    return native_pass.ctable.RoomTable(STAGES.index("prefill_send"), max_kept=MAX_STEPS)


def scan_into(table, ordered: list[Path], name, stats, say, native, budget: int,
              filters: Filters | None = None) -> tuple[list, list, list]:
    """The native pass over every file in reading order, its rows folded into `table` (the
    keys `filters` select); returns (the scans, (room, attempt, decode, in window, instance
    matches) of each record the reference reads, the odd lines' positions)."""
    filters = filters or Filters()
    if filters.active:
        table.select(math.nan if filters.since is None else float(filters.since),
                     math.nan if filters.until is None else float(filters.until),
                     filters.instance_ok if filters.instances else None)
    scans, py_records, odd_positions = [], [], []
    resident_at_start = resident_bytes()
    for i, path in enumerate(ordered):
        scan = native_pass.scan_file(path, i, native)
        scan.name = name(path)
        scans.append(scan)
        stats.lines += scan.n_valid
        if scan.fast:
            stats.fast_files += 1
            for cols in scan.rows:
                table.add(cols, i)
                stats.canonical_records += len(cols["room"])
            odd = [int(n) for chunk in scan.odd for n in chunk]
            stats.odd_lines += len(odd)
            if odd:
                _odd_records(scan, odd, py_records, filters)
                odd_positions.extend(position(i, n) for n in odd)
            scan.rows, scan.odd = [], []
        else:
            stats.slow_files += 1
            _slow_records(scan, py_records, filters)
        held = held_bytes(table, resident_at_start)
        if held > budget:
            raise OverBudget(f"the room table holds {held:,} bytes after {i + 1:,} files, "
                             f"over its budget of {budget:,} (--memory-limit)")
        say(f"scanned {i + 1:,}/{len(ordered):,} files, {stats.lines:,} lines checked, {len(table):,} keys "
            f"({stats.slow_files:,} files for the reference reader)")
    return scans, py_records, odd_positions


def _note(rec, fid: int, line: int, py_records: list, filters: Filters) -> None:
    """A record the reference reads: its key, and what the selection takes of it (as `pyrecs`)."""
    rows: list = []
    note_record(rec, fid, line, set(), rows)
    for room, attempt, _, decode, ts, inst in rows:
        py_records.append((room, attempt, decode, filters.in_window(ts), filters.instance_ok(inst)))


def _odd_records(scan, odd: list[int], py_records: list, filters: Filters) -> None:
    for line, raw in lines_of(scan.path, odd):
        try:
            rec = read_line(raw)
        except LineError:
            continue
        _note(rec, scan.order, line, py_records, filters)


def _slow_records(scan, py_records: list, filters: Filters) -> None:
    scan.rows, scan.odd = [], []
    with closing(read_file(scan.path)) as entries:
        for entry in entries:
            if entry.record is not None:
                _note(entry.record, scan.order, entry.line, py_records, filters)


def wanted_lines(table, odd_positions: list[int]) -> list[tuple[int, int]]:
    """(file rank, line) of every record of a complex key and every odd line, sorted."""
    positions = np.frombuffer(table.complex_positions(), np.int64)
    if odd_positions:
        positions = np.union1d(positions, np.asarray(odd_positions, np.int64))
    return list(zip((positions >> LINE_BITS).tolist(), (positions & LINE_MASK).tolist()))


def counts(table) -> dict:
    """The clean keys' counts and orders (`native.clean_counts`), stages by name."""
    c = native_pass.clean_counts(table)
    c["stages"] = {STAGES[s]: v for s, v in c["stages"].items()}
    return c


def coverage(table) -> list:
    """(outcome, instance, layout, cells, keys) of the clean keys, as `instances.clean_coverage`."""
    return [(*key, n) for key, n in sorted(table.clean_coverage().items(), key=lambda kv: repr(kv[0]))]


def file_names_json(ordered_files: list[str]) -> tuple[str, ...]:
    """Each file's name as JSON spells it inside a string, by rank."""
    return tuple(json_bytes(f).decode()[1:-1] for f in ordered_files)


SEPARATOR = b",\n"  # between two rooms' lines in `diff --json`


def clean_blocks(table, ordered_files: list[str]) -> Iterator[tuple[np.ndarray, np.ndarray, bytes]]:
    """The clean rooms' JSON in blocks of `JSON_BLOCK` rooms, in order of their first decode
    record: (first decode positions, where each line ends, the lines each followed by
    `SEPARATOR`), made in C and escaped by `json_safe` as `output` escapes a line."""
    names = file_names_json(ordered_files)
    start = 0
    while True:
        ords, ends, text, plain = table.clean_rooms_json(tuple(STAGES), tuple(VERDICTS), names, start,
                                                         start + JSON_BLOCK, SEPARATOR)
        if not ords:
            return
        ords, ends = np.frombuffer(ords, np.int64), np.frombuffer(ends, np.int64)
        # json_safe escapes only DEL and non-ASCII controls: `plain` says the C found none of those bytes
        if not plain and json_safe(text) is not text:
            # a control to escape (rare): line by line, new ends
            lines = [json_safe(text[a:e]) for a, e in zip([0, *(ends[:-1] + len(SEPARATOR)).tolist()], ends.tolist())]
            ends = np.cumsum([len(j) + len(SEPARATOR) for j in lines], dtype=np.int64) - len(SEPARATOR)
            text = b"".join(j + SEPARATOR for j in lines)
        yield ords, ends, text
        start += JSON_BLOCK


def prefill_only_line(room: str, attempt: int, rid) -> bytes:
    """A clean prefill-only key's line, as `output` writes it from SQL."""
    tail = "" if rid is None else f',"rid":{{"prefill":"{rid}","decode":null}}'
    return json_safe(f'{{"room":"{room}","attempt":{attempt},"verdict":"unverified","reason":"{PREFILL_ONLY_REASON}"'
                     f'{tail}}}'.encode())


def prefill_only_rooms(table) -> Iterator[tuple[int, bytes]]:
    for first, room, attempt, rid in table.prefill_only():
        yield first, prefill_only_line(room, attempt, rid)


def rooms_for_rids(table, rids: list[str], where) -> list:
    """[(first decode position, key, RoomResult)] of the clean rooms of these rids."""
    out = []
    for first, room, attempt, prid, drid, ptok, stages in table.rooms_for_rids(set(rids)):
        result = RoomResult(room, attempt, [], has_prefill=True, prefill_rid=prid, decode_rid=drid)
        for stage, step, live, ts, o in stages:
            file, line = where(o)
            result.stages.append(StageResult(STAGES[stage], step, "match", "", None if live < 0 else VERDICTS[live],
                                             ts, file, line, tokens=ptok))
        result.transfers = [ptok] if ptok is not None else []
        out.append((first, (room, attempt), result))
    return out


def timeline_chunks(table, size: int = 10_000) -> Iterator[list]:
    rows = table.timeline()
    for i in range(0, len(rows), size):
        yield rows[i:i + size]
