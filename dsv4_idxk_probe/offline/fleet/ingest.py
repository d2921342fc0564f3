"""Into DuckDB: the fast files' canonical room records, and the keys of every record
Python must read (odd lines of fast files, every line of slow files).

A key with any record Python reads is *complex*: the reference joiner judges all of its
records (`judge.py`). The scan's arrays go to DuckDB with each batch and are dropped.
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ...roomlog.lineformat import LineError, decode_line
from ...roomlog.reader import read_file
from ...roomlog.ridcap import cap_rid
from ..diff_output import json_bytes
from ..validation import RecordError, record_kind, room_fields
from .duck import insert_rows
from .ingest_sql import ingest_sql
from .positions import LINE_BITS, position
from .scan import FileScan, open_log

PYRECS = ("room", "attempt", "ord", "decode", "ts", "instance")  # columns of `pyrecs`


def ingest_batch(con, batch: list[FileScan], stats, py_keys: set) -> None:
    """One batch of fast files: their canonical room records into `rec`, the rest noted."""
    fids = np.concatenate([np.full(sum(len(a) for a in s.h), s.order, dtype=np.int32) for s in batch])
    lines = {
        "fid": fids,
        "h": np.concatenate([np.concatenate(s.h) if s.h else np.zeros(0, np.uint64) for s in batch]),
        "line": np.concatenate([np.concatenate(s.line) if s.line else np.zeros(0, np.int64) for s in batch]),
        "len": np.concatenate([np.concatenate(s.length) if s.length else np.zeros(0, np.int64) for s in batch]),
    }
    for s in batch:
        con.execute("INSERT INTO files VALUES (?, ?, ?, ?)", [s.order, str(s.path), s.order,
                                                              json_bytes(s.name or str(s.path)).decode()[1:-1]])
    con.register("lines_b", lines)
    try:
        for gz in (False, True):
            group = [s for s in batch if s.gzip == gz]
            if not group:
                continue
            con.execute(ingest_sql([str(s.path) for s in group], gz))
            _distribute(con, group, stats, py_keys)
    finally:
        con.unregister("lines_b")
    for s in batch:
        s.h, s.line, s.length = [], [], []  # the scan's arrays are in DuckDB now


def _distribute(con, group: list[FileScan], stats, py_keys: set) -> None:
    seen = {fid: (n, d) for fid, n, d in con.execute(
        "SELECT fid, count(*), count(DISTINCT line) FROM batch GROUP BY fid").fetchall()}
    # A line DuckDB's parser refused (a lone surrogate, not JSON) is missing from `batch`:
    # it is odd (Python reads it). A line matched twice means DuckDB split the file
    # otherwise than the scan: the reference reads that file.
    bad = [s for s in group if seen.get(s.order, (0, 0))[0] != seen.get(s.order, (0, 0))[1]]
    if bad:
        ids = [s.order for s in bad]
        con.execute("DELETE FROM batch WHERE list_contains(?, fid)", [ids])
        for s in bad:
            s.fast, s.why = False, "DuckDB read its lines differently"
            stats.fast_files -= 1
            stats.slow_files += 1
            slow_file_keys(s, py_keys, con)
    con.execute(f"INSERT INTO rec SELECT fid, (fid::BIGINT << {LINE_BITS}) | line, room, attempt, stage, step, ts, live, "
                "rid, tokens, dh, dvalid, instance, cells, layout FROM batch WHERE canon")
    ids = [s.order for s in group if s not in bad]
    odd = con.execute("""
        SELECT fid, line FROM batch WHERE NOT canon
        UNION ALL (SELECT fid, line FROM lines_b WHERE list_contains($ids, fid)
                   EXCEPT SELECT fid, line FROM batch)
        ORDER BY fid, line""", {"ids": ids}).fetchall()
    stats.canonical_records += con.execute("SELECT count(*) FROM batch WHERE canon").fetchall()[0][0]
    stats.odd_lines += len(odd)
    if odd:
        note_odd_lines(con, group, odd, py_keys)
    con.execute("DROP TABLE batch")


def note_odd_lines(con, group: list[FileScan], odd: list, py_keys: set) -> None:
    """Odd lines (fid, line), sorted: into `odd`, and their room records' keys to the
    Python join (their times and instances into `pyrecs`)."""
    insert_rows(con, "odd", ("fid", "line"), odd)
    by_file: dict[int, list[int]] = {}
    for fid, line in odd:
        by_file.setdefault(fid, []).append(line)
    scans = {s.order: s for s in group}
    rows: list = []
    for fid, wanted in by_file.items():
        for line, raw in lines_of(scans[fid].path, wanted):
            try:
                rec = read_line(raw)
            except LineError:
                continue
            note_record(rec, fid, line, py_keys, rows)
    insert_rows(con, "pyrecs", PYRECS, rows)


def read_line(raw: bytes) -> dict:
    """A line of a fast file as the reference reader reads it: parsed, and a long rid cut
    (`ridcap.cap_rid`), so the rooms print the rid the reference prints."""
    record = decode_line(raw)
    cap_rid(record)
    return record


def lines_of(path: Path, wanted: list[int]) -> Iterator[tuple[int, bytes]]:
    """The lines numbered `wanted` (sorted, 1-based) of a file the scan found whole."""
    f, _ = open_log(path)
    with f:
        it = iter(wanted)
        target = next(it, None)
        for n, raw in enumerate(f, 1):
            if target is None:
                return
            if n == target:
                yield n, raw
                target = next(it, None)


def note_record(rec: Any, file_rank: int, line: int, py_keys: set, rows: list) -> None:
    """A room record the Python join will read: its key joins the complex keys, and its
    time and instance go to `pyrecs` for the filters and the per-instance summary."""
    try:
        if record_kind(rec) != "room":
            return
        room, attempt, stage = room_fields(rec)[:3]
    except (RecordError, AttributeError, TypeError):
        return
    py_keys.add((room, attempt))
    ts, inst = rec.get("ts"), rec.get("instance")
    rows.append([room, attempt, position(file_rank, line), stage != "prefill_send",
                 float(ts) if type(ts) in (int, float) and abs(ts) < 1e300 else None,
                 inst if type(inst) is str else None])


def slow_file_keys(scan: FileScan, py_keys: set, con) -> None:
    """Keys of a file the reference reader reads: all of them go to the Python join."""
    scan.h, scan.line, scan.length, scan.rows, scan.odd = [], [], [], [], []
    rows: list = []
    with closing(read_file(scan.path)) as entries:
        for entry in entries:
            if entry.record is None:
                continue
            note_record(entry.record, scan.order, entry.line, py_keys, rows)
            if len(rows) >= 50_000:
                insert_rows(con, "pyrecs", PYRECS, rows)
                rows = []
    insert_rows(con, "pyrecs", PYRECS, rows)
