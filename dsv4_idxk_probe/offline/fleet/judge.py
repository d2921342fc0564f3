"""The complex keys, judged by the reference joiner itself.

Every record of the complex keys, with every record and error of the slow files and the
odd lines, is fed in reading order (file by file, line by line) to `join.Joiner`: verdicts,
localisation, diagnosis, bad lines and their messages are the reference's own.
"""

from __future__ import annotations

import gc
from collections import Counter
from pathlib import Path
from typing import Callable

from ...roomlog.lineformat import LineError
from ...roomlog.reader import read_file
from ..join import Joiner, cluster_of
from ..validation import RecordError, record_kind, room_fields
from .filters import Filters
from .ingest import lines_of, read_line
from .positions import LINE_MASK, position
from .scan import FileScan


def key_of(rec: dict) -> tuple:
    """The join's key of a room record that passed `room_fields`, as the joiner makes it."""
    room, attempt = room_fields(rec)[:2]
    cluster = cluster_of(rec) if "cluster" in rec else ""
    return (room, attempt, cluster) if cluster else (room, attempt)


def judge_complex(con, scans: list[FileScan], analysis, filters: Filters, say,
                  name: Callable[[Path], str] = str, wanted: list | None = None,
                  complex_keys: list | None = None) -> tuple:
    """Feed every record of the complex keys, the slow files and the odd lines to the
    reference joiner, in reading order (file by file, line by line); returns (the reading
    position of each key's first prefill record, (instance, role, key) -> records).
    `wanted`: the fast files' (file rank, line) to read, sorted, and `complex_keys` the
    complex keys, where no SQL says them (the room table's route)."""
    joiner = Joiner(analysis)
    first_prefill: dict = {}
    instances: Counter = Counter()  # (instance, role, key) seen in Python-read records
    wanted = wanted if wanted is not None else con.execute(f"""
        SELECT fid, line FROM (
            SELECT r.fid, r.ord & {LINE_MASK} AS line FROM rec r SEMI JOIN complex c USING (room, attempt)
            UNION SELECT fid, line FROM odd)
        ORDER BY fid, line""").fetchall()
    by_file: dict[int, list[int]] = {}
    for fid, line in wanted:
        by_file.setdefault(fid, []).append(line)
    selected = None
    if filters.active:
        selected = set(complex_keys) if complex_keys is not None else \
            {tuple(r) for r in con.execute("SELECT room, attempt FROM complex").fetchall()}
    fed = 0
    kind_first = analysis.kind_first

    def feed(rec: dict, file: str, line: int, order: int) -> None:
        nonlocal fed
        fed += 1
        if selected is not None:  # filters: only the selected keys' room records
            try:
                kind = rec.get("kind") if type(rec) is dict else None
                if kind == "room" and record_kind(rec) == "room":
                    room, attempt = room_fields(rec)[:2]
                    if (room, attempt) not in selected:
                        return
            except RecordError:
                pass
        n_kinds = len(analysis.record_kinds)
        try:
            joiner.add_record(rec, file, line)
        except RecordError as exc:
            analysis.error(f"{file}:{line}", str(exc))
            return
        finally:
            if len(analysis.record_kinds) > n_kinds:  # a kind seen first here (as the joiner names it)
                kind_first[next(reversed(analysis.record_kinds))] = position(order, line)
        if rec.get("kind") == "room":
            key = key_of(rec)
            if rec.get("stage") == "prefill_send":
                first_prefill.setdefault(key, position(order, line))
            inst = rec.get("instance")
            if type(inst) is str:
                instances[(inst, "prefill" if rec.get("stage") == "prefill_send" else "decode", key)] += 1

    gc_was = gc.isenabled()
    gc.disable()
    try:
        for scan in scans:
            file = name(scan.path)
            if not scan.fast:
                for entry in read_file(scan.path):
                    if entry.record is None:
                        analysis.error(f"{file}:{entry.line}", entry.error or "unreadable line")
                        continue
                    feed(entry.record, file, entry.line, scan.order)
            elif scan.order in by_file:
                for line, raw in lines_of(scan.path, by_file[scan.order]):
                    try:
                        rec = read_line(raw)
                    except LineError as exc:
                        analysis.error(f"{file}:{line}", "empty line" if raw.isspace() else str(exc))
                        continue
                    feed(rec, file, line, scan.order)
            say(f"reference join: {fed:,} records of complex keys and other lines")
        joiner.finish()
    finally:
        if gc_was:
            gc.enable()
    analysis.stats.python_records = fed
    return first_prefill, instances
