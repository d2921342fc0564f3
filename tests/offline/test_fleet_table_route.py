"""`diff` through the native room table (`fleet/table_route.py`, docs/fleet.md "The native
room table"): the same bytes as the reference join where the table judges, where it hands
rooms with too many steps to the joiner, where it writes the JSON in small blocks, and
where it outgrows its memory budget and DuckDB starts over; prefill-only keys' duplicates
and conflicts counted as the reference counts them."""

from __future__ import annotations

import copy

import pytest
from tests.offline.test_fleet_equivalence import assert_same, write
from tests.support.logdata import Fault, RoomPlan, room_records, write_logs

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


def test_filters_and_per_instance_take_duckdb():
    native = fleet.native.module()
    assert route.why_not(native, fleet.Filters(), False) is None
    assert "--since" in route.why_not(native, fleet.Filters(since=1.0), False)
    assert "--per-instance" in route.why_not(native, fleet.Filters(), True)
    assert route.why_not(None, fleet.Filters(), False) == "the native line pass is off"
