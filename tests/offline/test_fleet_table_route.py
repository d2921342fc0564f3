"""`diff` through the native room table (`fleet/table_route.py`, docs/fleet.md "The native
room table"): the same bytes as the reference join where the table judges, where it hands
rooms with too many steps to the joiner, where it writes the JSON in small blocks, and
where it outgrows its memory budget and DuckDB starts over; prefill-only keys' duplicates
and conflicts counted as the reference counts them."""

from __future__ import annotations

import copy
import json

import pytest
from tests.offline.test_fleet_equivalence import assert_same, write
from tests.support.logdata import Fault, RoomPlan, room_records, write_logs

from dsv4_idxk_probe.cli.main import run as fleet_run
from dsv4_idxk_probe.offline import fleet
from dsv4_idxk_probe.roomlog import encode_line
from dsv4_idxk_probe.roomlog.reader import expand_inputs

pytest.importorskip("duckdb")
route = fleet.table_route


@pytest.fixture(autouse=True)
def table_on(monkeypatch):
    monkeypatch.delenv(fleet.native.ENV, raising=False)
    monkeypatch.delenv(route.ENV, raising=False)
    if fleet.native.module() is None or fleet.native.ctable is None:
        pytest.fail("the native line pass or room table is not built (`pip install -e .` builds both)")


def analysed(*inputs):
    analysis = fleet.analyse_fleet(expand_inputs(map(str, inputs)))
    analysis.close()
    return analysis.stats


def mixed_logs(root):
    plans = [RoomPlan(i, fault=Fault(0, 1, 2) if i % 5 == 0 else None, decode=i % 7 != 0) for i in range(1, 30)]
    return write_logs(root, plans, max_bytes=6000, gzip_rotated=False)


def test_the_table_judges_the_clean_keys_and_diff_is_the_references(tmp_path, capsys):
    prefill, decode = mixed_logs(tmp_path / "logs")
    report = assert_same(capsys, tmp_path, prefill, decode)
    assert report["summary"]["room_verdicts"]["mismatch"] == 5
    stats = analysed(prefill, decode)
    assert stats.clean_judge == "room table" and stats.table_fallbacks == 0
    assert stats.clean_keys == 29 - 5 and stats.complex_keys == 5  # every prefill-only key is clean too
    assert stats.python_records < stats.canonical_records / 2


def test_json_made_in_blocks_of_two_rooms_is_the_same(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(route, "JSON_BLOCK", 2)
    prefill, decode = mixed_logs(tmp_path / "logs")
    assert_same(capsys, tmp_path, prefill, decode)


def test_a_room_past_the_step_cap_goes_to_the_joiner(tmp_path, capsys, monkeypatch):
    plans = [RoomPlan(1, steps=(10, 20, 30, 40)), RoomPlan(2), RoomPlan(3, steps=(10,))]
    prefill, decode = write_logs(tmp_path / "logs", plans)
    base = analysed(prefill, decode)
    monkeypatch.setattr(route, "MAX_STEPS", 3)  # room 1 keeps recv + 4 steps + finish
    capped = analysed(prefill, decode)
    assert (base.complex_keys, capped.complex_keys) == (0, 1)
    assert capped.python_records > base.python_records
    assert_same(capsys, tmp_path, prefill, decode)


def test_over_its_memory_budget_the_table_gives_way_to_duckdb(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(route, "budget_bytes", lambda limit: 1000)
    prefill, decode = mixed_logs(tmp_path / "logs")
    lines = []
    analysis = fleet.analyse_fleet(expand_inputs([str(prefill), str(decode)]), progress=lines.append)
    analysis.close()
    assert analysis.stats.table_fallbacks == 1
    assert analysis.stats.clean_judge.startswith("DuckDB (the room table holds")
    assert any("starting over with DuckDB" in line for line in lines)
    assert_same(capsys, tmp_path, prefill, decode)


def test_prefill_only_duplicates_and_conflicts_as_the_reference_counts_them(tmp_path, capsys):
    pre = []
    for i in (1, 2, 3):
        p, _ = room_records(RoomPlan(i, decode=False))
        pre += p
    p1 = [r for r in pre if r["room"] == "1"]
    pre += copy.deepcopy(p1)  # room 1 sent twice, the same digest: a duplicate
    other, _ = room_records(RoomPlan(9))  # room 2 again with another room's digest: a conflict
    p2 = copy.deepcopy(next(r for r in pre if r["room"] == "2"))
    p2["digest"] = other[0]["digest"]
    pre.append(p2)
    matched_p, matched_d = room_records(RoomPlan(4))
    write(tmp_path / "p" / "prefill-a.jsonl", [encode_line(r) for r in pre + matched_p])
    write(tmp_path / "d" / "decode-a.jsonl", [encode_line(r) for r in matched_d])
    report = assert_same(capsys, tmp_path, tmp_path / "p", tmp_path / "d")
    summary = report["summary"]
    assert summary["duplicate_records"] >= 1 and summary["conflicting_prefill_records"] >= 1
    assert len(report["prefill_only"]) == 3
    assert analysed(tmp_path / "p", tmp_path / "d").clean_judge == "room table"


@pytest.mark.parametrize("spelling, expected", [
    ("1GB", 1_500_000_000), ("512MiB", 768 << 20), ("1.5 gb", 2_250_000_000), ("2048", 3072), ("lots", 3 << 29),
])
def test_the_budget_is_read_from_the_memory_limit(spelling, expected):
    assert route.budget_bytes(spelling) == expected


def test_what_the_table_holds_is_counted_resident_or_estimated(tmp_path):
    prefill, decode = mixed_logs(tmp_path / "logs")
    table = route.new_table()
    start = route.resident_bytes()
    assert start is None or start > 0
    stats = fleet.FleetStats()
    route.scan_into(table, sorted(expand_inputs([str(prefill), str(decode)])), str, stats, lambda *a, **k: None,
                    fleet.native.module(), 1 << 40)
    assert len(table) == 29 and table.nbytes > 29 * 200  # entries, kept stages, strings
    assert route.held_bytes(table, None) == table.nbytes
    assert route.held_bytes(table, 0) >= table.nbytes  # all of this process's memory, where readable


def test_per_instance_takes_duckdb_and_the_filters_do_not():
    native = fleet.native.module()
    assert route.why_not(native, fleet.Filters(), False) is None
    assert route.why_not(native, fleet.Filters(since=1.0, instances=("d-*",)), False) is None
    assert "--per-instance" in route.why_not(native, fleet.Filters(), True)
    assert route.why_not(None, fleet.Filters(), False) == "the native line pass is off"


def selection_logs(root):
    """Rooms 1..12 at ts 1000 + 10 i (prefill) and + 1.. (decode), prefill on p-<i%2>, decode
    on d-<i%3>: room 3 mismatches, room 5 is never decoded, room 7 never sent, room 9's
    decode_finish is an odd line (a float step: the reference reads it), room 11 decodes
    late (ts 2000..), a slow file holds room 12 (a bad line beside it)."""
    pre, dec, slow = [], [], []
    for i in range(1, 13):
        p, d = room_records(RoomPlan(i, fault=Fault(1, 1, 5, "decode_finish") if i == 3 else None))
        for r in p:
            r["ts"], r["instance"] = 1000.0 + 10 * i, f"p-{i % 2}:1"
        for k, r in enumerate(d, 1):
            r["ts"], r["instance"] = (2000.0 if i == 11 else 1000.0 + 10 * i) + k, f"d-{i % 3}:7"
        if i == 9:
            d[-1]["step"] = float(d[-1]["step"] or 0) + 0.5
        if i == 12:
            slow += p + d
            continue
        pre += [] if i == 7 else p
        dec += [] if i == 5 else d
    write(root / "p" / "prefill-a-1.000001.jsonl", [encode_line(r) for r in pre])
    write(root / "d" / "decode-b-2.000001.jsonl", [encode_line(r) for r in dec])
    write(root / "d" / "decode-c-3.000001.jsonl", [encode_line(r) for r in slow] + [b"not json\n"])
    return root / "p", root / "d"


SELECTED = {  # (rooms, prefill-only rooms)
    # decoded from 1045 on (11 late, 12 in the slow file; 7 never sent); 5 sent at 1050, never decoded
    ("--since", "1045"): (["10", "11", "12", "6", "7", "8", "9"], ["5"]),
    ("--since", "1500"): (["11"], []),
    # a record of p-1 (odd rooms' prefill): 7 was never sent, 5 never decoded
    ("--instance", "p-1:*"): (["1", "11", "3", "9"], ["5"]),
    ("--instance", "nobody"): ([], []),
}


@pytest.mark.parametrize("selection", [
    ("--since", "1045"), ("--until", "1075"), ("--since", "1052", "--until", "1101.5"), ("--since", "1500"),
    ("--instance", "d-0:*"), ("--instance", "p-1:*"), ("--instance", "d-2:7", "--until", "1090"),
    ("--instance", "nobody"),
])
def test_the_selection_in_the_table_is_the_selection_in_sql(tmp_path, capsys, monkeypatch, selection):
    """--since/--until/--instance on the room table: the same table, JSON and exit status as
    on the DuckDB route, with complex, odd, slow, prefill-only and decode-only keys about."""
    p, d = selection_logs(tmp_path / "logs")
    out = {}
    for judge in ("table", "duckdb"):
        if judge == "duckdb":
            monkeypatch.setenv(route.ENV, "0")
        path = tmp_path / f"{judge}.json"
        status = fleet_run(["diff", str(p), str(d), "--json", str(path), *selection])
        out[judge] = (status, capsys.readouterr().out, path.read_bytes())
    assert out["table"] == out["duckdb"]
    report = json.loads(out["table"][2])
    want = SELECTED.get(selection)
    if want is not None:  # what the rule selects, by construction of the logs
        assert (sorted(r["room"] for r in report["rooms"]), [r["room"] for r in report["prefill_only"]]) == want
    monkeypatch.delenv(route.ENV)
    lines = []
    analysis = fleet.analyse_fleet(expand_inputs([str(p), str(d)]), filters=_filters(selection),
                                   progress=lines.append)
    analysis.close()
    assert analysis.stats.clean_judge == "room table"


def _filters(selection) -> "fleet.Filters":
    args = dict(zip(selection[::2], selection[1::2]))
    return fleet.Filters(float(args["--since"]) if "--since" in args else None,
                         float(args["--until"]) if "--until" in args else None,
                         (args["--instance"],) if "--instance" in args else ())
