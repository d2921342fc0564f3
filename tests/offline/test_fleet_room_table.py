"""The native room table (`ctable.RoomTable`, offline/fleet/ctable.c; docs/fleet.md, "The
native room table"): each key's clean-or-complex judgment made in C from the native pass's
rows, against the SQL classification (`classify.CLASSIFY`) of the same files, key for key,
and against the rule itself on rooms built to sit on each edge of it; and the clean rooms'
JSON it writes against the SQL-written lines of `diff --json`, byte for byte, and its
counts against those `summary.merge` takes from SQL."""

from __future__ import annotations

import copy

import pytest
from tests.offline.test_fleet_equivalence import SETS, hostile_set, write
from tests.support.logdata import Fault, RoomPlan, room_records, write_logs

from dsv4_idxk_probe.offline import fleet
from dsv4_idxk_probe.offline.diff_output import json_bytes
from dsv4_idxk_probe.offline.fleet import output as fleet_output
from dsv4_idxk_probe.offline.join import prefill_files_first
from dsv4_idxk_probe.roomlog import encode_line
from dsv4_idxk_probe.roomlog.reader import expand_inputs

pytest.importorskip("duckdb")
native = fleet.native


@pytest.fixture(autouse=True)
def native_pass(monkeypatch):
    monkeypatch.delenv(native.ENV, raising=False)
    monkeypatch.setenv(fleet.table_route.ENV, "0")  # `sql_judgment` reads the DuckDB route's tables
    if native.cscan is None or native.ctable is None:
        pytest.fail("the native line pass or room table is not built (`pip install -e .` builds both)")
    return native.cscan


def sql_judgment(paths) -> tuple[dict, list, list]:
    """{(room, attempt): 'clean' | 'prefill_only' | 'complex'} as the SQL classification
    says, the keys the reference reads a record of (`pykeys`), and the clean rooms' JSON
    lines as `diff --json` writes them from SQL."""
    analysis = fleet.analyse_fleet(paths)
    try:
        con = analysis.con
        out = {}
        for table, name in (("clean", "clean"), ("clean_po", "prefill_only"), ("complex", "complex")):
            for room, attempt in con.execute(f"SELECT room, attempt FROM {table}").fetchall():
                assert (room, attempt) not in out, (room, attempt, table)
                out[(room, attempt)] = name
        pykeys = con.execute("SELECT room, attempt FROM pykeys").fetchall()
        rooms = list(fleet_output._clean_rooms(con)) if analysis.clean_rooms else []
        names = ("rooms", "open", "live", "duplicates", "records", "first_record", "prefill_only", "conflicts",
                 "first_decode")
        counts = dict(zip(names, con.execute(SQL_COUNTS).fetchall()[0]))
    finally:
        analysis.close()
    for name in ("first_record", "first_decode"):
        counts[name] = -1 if counts[name] is None else counts[name]
    return out, pykeys, (rooms, {k: int(v) for k, v in counts.items()})


SQL_COUNTS = """
    SELECT (SELECT count(*) FROM clean),
           (SELECT count(*) FROM clean c ANTI JOIN (SELECT room, attempt FROM kept WHERE stage = 'decode_finish') f
                USING (room, attempt)),
           (SELECT count(*) FROM kept WHERE live IN ('mismatch', 'not_comparable')),
           (SELECT coalesce(sum(n - 1), 0) FROM kept) + (SELECT coalesce(sum(p - 1), 0) FROM clean)
             + (SELECT coalesce(sum(same - 1), 0) FROM po_stats),
           (SELECT count(*) FROM rec r SEMI JOIN clean_keys c USING (room, attempt)),
           (SELECT min(r.ord) FROM rec r SEMI JOIN clean_keys c USING (room, attempt)),
           (SELECT count(*) FROM clean_po),
           (SELECT coalesce(sum(n - same), 0) FROM po_stats),
           (SELECT min(first_d) FROM clean)
"""  # what summary.merge takes from SQL for the clean keys


def table_judgment(paths, pykeys) -> tuple[dict, list]:
    """The same keys judged by the room table, fed the native pass's rows file by file, and
    the clean rooms' JSON lines it writes."""
    table = native.room_table()
    ordered = sorted(paths, key=prefill_files_first)
    for i, path in enumerate(ordered):
        scan = native.scan_file(path, i, native.cscan)
        if scan.fast:
            for cols in scan.rows:
                table.add(cols, i)
    table.mark_complex(pykeys)
    judged = table.judge()
    counts = table.counts()
    assert len(table) == len(judged) == sum(counts.values())
    assert all(counts[v] == sum(1 for x in judged.values() if x == v) for v in counts)
    assert table.nbytes > 0 or not judged
    rooms = native.clean_rooms(table, [json_bytes(str(p)).decode()[1:-1] for p in ordered])
    return judged, (rooms, native.clean_counts(table))


def assert_same_judgment(*inputs) -> dict:
    paths = expand_inputs(map(str, inputs))
    sql, pykeys, (sql_rooms, sql_counts) = sql_judgment(paths)
    got, (rooms, counts) = table_judgment(paths, pykeys)
    differ = {k: (sql.get(k), got.get(k)) for k in set(sql) | set(got) if sql.get(k) != got.get(k)}
    assert not differ, differ
    assert {k: v for k, v in counts.items() if k != "stages"} == sql_counts
    assert len(rooms) == len(sql_rooms) == sum(v == "clean" for v in got.values())
    for mine, theirs in zip(rooms, sql_rooms):
        assert mine == theirs
    return got


# %% against SQL on the equivalence tests' log sets


@pytest.mark.parametrize("name", SETS)
def test_same_judgment_as_sql_on_the_observability_log_sets(name, tmp_path):
    prefill, decode = write_logs(tmp_path / "logs", SETS[name]())
    judged = assert_same_judgment(prefill, decode)
    assert judged


def test_same_judgment_as_sql_on_hostile_lines(tmp_path):
    judged = assert_same_judgment(*hostile_set(tmp_path / "logs"))
    kinds = set(judged.values())
    assert {"clean", "complex"} <= kinds, kinds


def test_same_judgment_as_sql_on_rotated_files_split_across_instances(tmp_path):
    plans = [RoomPlan(i, attempt=i % 2, steps=(40, 80), fault=Fault(0, 1, 2) if i % 5 == 0 else None)
             for i in range(1, 30)]
    prefill, decode = write_logs(tmp_path / "logs", plans, max_bytes=5000, gzip_rotated=False)
    assert len(list(decode.glob("*.jsonl"))) > 4
    judged = assert_same_judgment(decode, prefill)
    assert sum(v == "complex" for v in judged.values()) == 5


# %% the rule's edges, one room each, in files of their own


def _room(i: int, **plan) -> tuple[list[dict], list[dict]]:
    return room_records(RoomPlan(i, **plan))


def _edges() -> tuple[list[dict], list[dict], list[dict], dict]:
    """(prefill records, decode records in file 1, decode records in file 2, expected judgment)."""
    pre, dec1, dec2, want = [], [], [], {}

    def add(i, verdict, p, d, split=False):
        pre.extend(p)
        if split:  # the decode records across two files, the later stages first
            dec2.extend(d[:1])
            dec1.extend(d[1:])
        else:
            dec1.extend(d)
        want[(str(i), 0)] = verdict

    p, d = _room(1)
    add(1, "clean", p, d)
    p, d = _room(2)
    add(2, "clean", p, d, split=True)
    p, d = _room(3)  # one decode record's digest differs (a cell of one page)
    r = d[1]
    r["digest"]["pages"][0] = f"{int(r['digest']['pages'][0], 16) ^ 1:016x}"
    add(3, "complex", p, d)
    p, d = _room(4)  # the prefill record twice, the same bytes: a duplicate, still clean
    add(4, "clean", p + copy.deepcopy(p), d + copy.deepcopy(d[1:2]))
    p, d = _room(5)  # the prefill record twice, the second with another rid
    p2 = copy.deepcopy(p)
    p2[0]["rid"] = "another"
    add(5, "complex", p + p2, d)
    p, d = _room(6)  # a rid, then none
    p[0]["rid"] = "req-6"
    add(6, "complex", p + [dict(p[0], rid=None)], d)
    p, d = _room(7)  # a decode record without digest
    d[2]["digest"] = None
    add(7, "complex", p, d)
    p, d = _room(8)  # prefill only
    add(8, "prefill_only", p, [])
    p, d = _room(9)  # prefill only, twice the same
    add(9, "prefill_only", p + copy.deepcopy(p), [])
    p, d = _room(10)  # decode only
    add(10, "complex", [], d)
    p, d = _room(11)  # prefill without digest, decoded
    p[0]["digest"] = None
    add(11, "complex", p, d)
    p, d = _room(12)  # prefill only, without digest: the reference's unverified prefill-only
    p[0]["digest"] = None
    add(12, "prefill_only", p, [])
    p, d = _room(13)  # prefill's digest not one pack_digest accepts (rows unlike segments)
    p[0]["digest"]["layer_segment"] = p[0]["digest"]["layer_segment"][:-1]
    add(13, "complex", p, [])
    p, d = _room(14)  # two prefill records with different digests, decode equal to the first
    p2 = copy.deepcopy(p)
    p2[0]["digest"]["pages"][0] = f"{int(p2[0]['digest']['pages'][0], 16) ^ 1:016x}"
    add(14, "complex", p + p2, d)
    p, d = _room(15)  # the same room id, another attempt: its own key
    pa, da = room_records(RoomPlan(15, attempt=1, fault=Fault(0, 0, 0)))
    add(15, "clean", p + pa, d + da)
    want[("15", 1)] = "complex"
    p, d = _room(16)  # clean, with live verdicts the decode side wrote and a decode rid after none
    d[1]["verdict"], d[2]["verdict"] = "mismatch", "match"
    d[1]["rid"], d[2]["rid"] = None, "dec-16"
    add(16, "clean", p, d, split=True)
    p, d = _room(17)  # clean and open: no decode_finish record
    assert d[-1]["stage"] == "decode_finish"
    add(17, "clean", p, d[:-1])
    return pre, dec1, dec2, want


def test_the_rule_on_each_edge_and_the_same_as_sql(tmp_path):
    pre, dec1, dec2, want = _edges()
    write(tmp_path / "p" / "prefill-e-1.000001.jsonl", [encode_line(r) for r in pre])
    write(tmp_path / "d" / "decode-e-2.000001.jsonl", [encode_line(r) for r in dec1])
    write(tmp_path / "d" / "decode-e-3\u202e.000001.jsonl", [encode_line(r) for r in dec2])
    judged = assert_same_judgment(tmp_path / "p", tmp_path / "d")
    assert judged == want
    table_rooms, counts = table_judgment(expand_inputs([str(tmp_path / "p"), str(tmp_path / "d")]), [])[1]
    table_rooms = dict(table_rooms)
    clean = sum(v == "clean" for v in want.values())
    both = sum(v != "complex" for v in want.values())
    assert {k: counts[k] for k in ("rooms", "open", "live", "duplicates", "prefill_only")} == {
        "rooms": clean, "open": 1, "live": 1, "duplicates": 3,  # room 17; room 16; room 4's prefill and decode, room 9's prefill
        "prefill_only": sum(v == "prefill_only" for v in want.values())}
    assert counts["first_record"] == 1 and both < counts["records"]
    room16 = next(j for j in table_rooms.values() if j.startswith(b'{"room":"16"'))
    assert b'"live_verdict":"mismatch"' in room16 and b'"decode":"dec-16"' in room16
    assert b'decode-e-3\\u202e.000001.jsonl:' in room16  # a control in a file name, escaped


def test_a_key_the_reference_reads_is_complex_seen_or_not(tmp_path):
    pre, dec = _room(1)
    table = native.room_table()
    for cols in native.scan_file(write(tmp_path / "a.jsonl", [encode_line(r) for r in pre + dec]), 0,
                                 native.cscan).rows:
        table.add(cols, 0)
    assert table.judge() == {("1", 0): "clean"}
    table.mark_complex([("2", 0)])
    assert table.judge() == {("1", 0): "clean", ("2", 0): "complex"}
    table.mark_complex([("1", 0)])
    assert table.counts() == {"clean": 0, "prefill_only": 0, "complex": 2}


def test_many_keys_grow_the_table_and_keep_each_one(tmp_path):
    """Past several resizes every key keeps its own state (a decode-only key among clean ones)."""
    lines = []
    for i in range(1, 1501):
        pre, dec = _room(i % 7)
        for r in pre + dec:
            r["room"] = f"r{i}"
        lines += [encode_line(r) for r in (dec if i % 100 == 0 else pre + dec)]
    path = write(tmp_path / "many.jsonl", lines)
    judged = assert_same_judgment(path)
    assert len(judged) == 1500
    assert sum(v == "complex" for v in judged.values()) == 15


def test_rooms_past_the_entrys_inline_text_and_stages_past_its_inline_ones(tmp_path):
    """Rooms of 24 bytes and less are kept in their entry, longer ones in the arena; a room's
    first three decode stages in its entry, more on the heap: the same judgment and JSON."""
    lines = []
    for i, room in enumerate(["9" * 23, "8" * 24, "7" * 25, "r" * 200, "6" * 19], start=1):
        pre, dec = room_records(RoomPlan(i, steps=(32, 64, 96, 128) if i % 2 else (32,),
                                         fault=Fault(0, 1, 2) if i == 3 else None))
        for r in pre + dec:
            r["room"] = room
        lines += [encode_line(r) for r in pre + dec]
    judged = assert_same_judgment(write(tmp_path / "long.jsonl", lines))
    assert len(judged) == 5 and sum(v == "complex" for v in judged.values()) == 1


def test_bad_columns_are_refused_with_a_message():
    table = native.room_table()
    with pytest.raises(ValueError, match="room and rid"):
        table.add({"room": ["a"]})
    with pytest.raises(ValueError, match="list instance"):
        table.add({"room": ["a"], "rid": [None], "attempt": b"", "stage": b"\0", "flags": b"\0", "dh": bytes(8)})
    with pytest.raises(ValueError, match="list instance"):
        table.add({"room": ["a"], "rid": [None], "instance": []})
    with pytest.raises(ValueError, match="column attempt"):
        table.add({"room": ["a"], "rid": [None], "instance": [None], "layout": ["x"], "attempt": b""})
    with pytest.raises(TypeError):
        table.mark_complex([(1, 0)])
    assert len(table) == 0
