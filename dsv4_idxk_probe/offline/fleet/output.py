"""`diff --json` of a fleet analysis: the reference's document, byte for byte.

The SQL-judged rooms' JSON is made in DuckDB (one external sort, which spills), or by the
native room table in blocks (`table_route.clean_rooms`), and merged
with the Python rooms' by reading position, so every room comes in the reference's order
(first decode record in reading order) without all of them in memory.
"""

from __future__ import annotations

from typing import BinaryIO, Iterator

import numpy as np

from ..diff_output import json_bytes, json_head, write_document
from ..printable import json_safe
from .positions import LINE_BITS, LINE_MASK
from .table_route import SEPARATOR, clean_blocks, prefill_only_rooms


def _clean_stage_rows_sql() -> str:
    """Every kept stage of the clean rooms as its JSON text, in the reference's room order
    (first decode record) and stage order (stage, step, reading order): one external sort,
    which spills, where a per-room string_agg would have to hold its groups in memory."""
    stage_json = (
        "'{\"stage\":\"' || k.stage || '\",\"step\":' || coalesce(k.step::VARCHAR, 'null')"
        " || ',\"verdict\":\"match\"' || coalesce(',\"tokens\":' || c.ptok::VARCHAR, '')"
        " || CASE WHEN k.live IS NOT NULL AND k.live <> 'match' THEN ',\"live_verdict\":\"' || k.live || '\"' ELSE '' END"
        f" || ',\"where\":\"' || f.wesc || ':' || (k.ord & {LINE_MASK})::VARCHAR || '\"}}'"
    )
    stage_rank = "CASE k.stage WHEN 'decode_recv' THEN 0 WHEN 'decode_step' THEN 1 ELSE 2 END"
    return f"""
        SELECT c.first_d, c.room, c.attempt, c.prid, c.drid, k.stage = 'decode_finish', {stage_json}
        FROM clean c JOIN kept k USING (room, attempt) JOIN files f ON f.fid = (k.ord >> {LINE_BITS})
        ORDER BY c.first_d, {stage_rank}, coalesce(k.step, 0), k.ord
    """


def _clean_rooms(con) -> Iterator[tuple[int, bytes]]:
    """(first decode ord, the room's JSON line) of every clean room, as `RoomResult.to_json`
    and the reference's writer make it."""
    cur = con.execute(_clean_stage_rows_sql())
    current, parts, closed, head = None, [], False, ""

    def line() -> bytes:
        return json_safe(f'{head}{",".join(parts)}],"closed":{"true" if closed else "false"}}}'.encode())

    while True:
        chunk = cur.fetchmany(50_000)
        if not chunk:
            break
        for first, room, attempt, prid, drid, finish, sj in chunk:
            if first != current:
                if current is not None:
                    yield current, line()
                current, parts, closed = first, [], False
                head = (f'{{"room":"{room}","attempt":{attempt},"rid":{{"prefill":'
                        f'{"null" if prid is None else chr(34) + prid + chr(34)},"decode":'
                        f'{"null" if drid is None else chr(34) + drid + chr(34)}}},"verdict":"match",'
                        '"first_divergence":null,"last_match_before":null,"stages":[')
            parts.append(sj)
            closed = closed or finish
    if current is not None:
        yield current, line()


def _clean_po_json_sql() -> str:
    return """
        SELECT first_p AS ord,
               '{"room":"' || room || '","attempt":' || attempt::VARCHAR
               || ',"verdict":"unverified","reason":"prefill sent it; no decode record in these logs"'
               || coalesce(',"rid":{"prefill":"' || prid || '","decode":null}', '') || '}' AS j
        FROM clean_po
    """


def write_fleet_json(analysis, path: str, status: int) -> None:
    """`diff --json` for a fleet analysis: the reference's document, rooms streamed from DuckDB."""
    head = json_head(analysis, status)
    if analysis.per_instance is not None:
        head["instances"] = analysis.per_instance
    write_document(path, lambda f: _write_to(f, analysis, head))


def _merged(sql_rows: Iterator[tuple[int, bytes]], py_rows: list[tuple[int, bytes]]) -> Iterator[bytes]:
    """Two streams of (ord, JSON line), each in ord order, as one."""
    py_rows.sort(key=lambda r: r[0])
    i = 0
    for o, j in sql_rows:
        while i < len(py_rows) and py_rows[i][0] < o:
            yield py_rows[i][1]
            i += 1
        yield j
    while i < len(py_rows):
        yield py_rows[i][1]
        i += 1


def _clean_po(con) -> Iterator[tuple[int, bytes]]:
    cur = con.execute(f"SELECT ord, j FROM ({_clean_po_json_sql()}) ORDER BY ord")
    while True:
        chunk = cur.fetchmany(50_000)
        if not chunk:
            return
        for o, j in chunk:
            yield o, json_safe(j.encode())


def _write_list(f: BinaryIO, lines: Iterator[bytes]) -> None:
    """JSON lines separated by ",\n", written in blocks."""
    separator = b""
    buf: list = []
    for j in lines:
        buf.append(separator)
        buf.append(j)
        separator = b",\n"
        if len(buf) >= 20_000:
            f.write(b"".join(buf))
            buf = []
    f.write(b"".join(buf))


def _write_blocks(f: BinaryIO, blocks, py_rows: list[tuple[int, bytes]]) -> None:
    """The room table's blocks of clean rooms (`table_route.clean_blocks`) merged with the
    Python rooms (ord, JSON line) by reading position, written as `_write_list` writes:
    whole runs of clean rooms at once, a Python room between two where it falls."""
    py_rows.sort(key=lambda r: r[0])
    i, first = 0, True

    def emit(data) -> None:
        nonlocal first
        if not first:
            f.write(SEPARATOR)
        f.write(data)
        first = False

    for ords, ends, text in blocks:
        view = memoryview(text)
        at, n = 0, len(ords)
        while at < n:
            if i < len(py_rows) and py_rows[i][0] < ords[at]:
                emit(py_rows[i][1])
                i += 1
                continue
            cut = int(np.searchsorted(ords, py_rows[i][0])) if i < len(py_rows) else n
            emit(view[0 if at == 0 else int(ends[at - 1]) + len(SEPARATOR):int(ends[cut - 1])])
            at = cut
    for _, j in py_rows[i:]:
        emit(j)


def _write_to(f: BinaryIO, analysis, head: dict) -> None:
    f.write(json_bytes(head)[:-1])
    f.write(b',"rooms":[\n')
    room_positions = dict(analysis.room_positions)
    py = [(room_positions.get(k, 0), json_bytes(r.to_json())) for k, r in analysis.rooms.items()]
    table = analysis.table
    if analysis.clean_rooms and table is not None:
        _write_blocks(f, clean_blocks(table, analysis.ordered_files), py)
    else:
        rows = _clean_rooms(analysis.con) if analysis.clean_rooms and analysis.con is not None else iter(())
        _write_list(f, _merged(rows, py))
    f.write(b'\n],"prefill_only":[\n')
    py = []
    for key in analysis.prefill_only_keys:
        entry = {"room": key[0], "attempt": key[1], "verdict": "unverified",
                 "reason": "prefill sent it; no decode record in these logs"}
        if len(key) > 2:  # (room, attempt, cluster), as the reference writes it
            entry["cluster"] = key[2]
        rid = analysis.prefill_only_rids.get(key)
        if rid is not None:
            entry["rid"] = {"prefill": rid, "decode": None}
        py.append((analysis.prefill_only_positions.get(key, 0), json_bytes(entry)))
    if not analysis.clean_prefill_only:
        rows = iter(())
    elif table is not None:
        rows = prefill_only_rooms(table)
    else:
        rows = _clean_po(analysis.con) if analysis.con is not None else iter(())
    _write_list(f, _merged(rows, py))
    f.write(b"\n]}\n")
