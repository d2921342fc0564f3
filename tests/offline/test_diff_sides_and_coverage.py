"""`diff` on one side's logs, and coverage per instance, on both join engines.

Logs of one side only (the on-call grabs the alerting pod's first) must not read as an
all-clear: diff names the missing side and exits 1 when decode's live verdicts said mismatch
(2 when nothing could be judged). Coverage per instance: rooms and index-K bytes verified
and not, with the join's reasons; both engines print and write the very same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.support.logdata import LAYER_IDS, LAYOUT, N_TOKENS, Fault, RoomPlan, room_records

from dsv4_idxk_probe.cli.main import run
from dsv4_idxk_probe.roomlog import RoomLogWriter

ENGINES = ("reference", "duckdb")
ROOM_BYTES = len(LAYER_IDS) * -(-N_TOKENS // LAYOUT.page_tokens) * LAYOUT.row_bytes


def engines():
    try:
        import duckdb  # noqa: F401
    except ImportError:
        return ("reference",)
    return ENGINES


def write_side(directory: Path, role: str, records: list[dict]) -> Path:
    writer = RoomLogWriter(directory, role, max_files=100)
    for rec in records:
        assert writer.emit(rec)
    writer.close()
    return directory


def live_mismatch_logs(plans: list[RoomPlan]) -> tuple[list[dict], list[dict]]:
    """Both sides' records, decode's live verdict `mismatch` from each fault's stage on (what
    decode says live when the exchange delivered prefill's digest)."""
    prefill, decode = [], []
    order = ("decode_recv", "decode_step", "decode_finish")
    for plan in plans:
        pre, dec = room_records(plan)
        for rec in dec:
            if plan.fault is not None and order.index(rec["stage"]) >= order.index(plan.fault.from_stage):
                rec["verdict"] = "mismatch"
        prefill += pre
        decode += dec
    return prefill, decode


def diff(capsys, tmp_path: Path, *inputs, extra=()) -> dict:
    """Run diff with each engine; the same status, table and JSON from both; return the
    reference's (status, stdout, stderr, json)."""
    got = {}
    for engine in engines():
        path = tmp_path / f"{engine}.json"
        status = run(["diff", *map(str, inputs), "--engine", engine, "--json", str(path), *extra])
        captured = capsys.readouterr()
        got[engine] = (status, captured.out, captured.err, path.read_bytes())
    got = {engine: (status, " ".join(out.split()), " ".join(err.split()), doc)  # wrapped lines, read as one
           for engine, (status, out, err, doc) in got.items()}
    ref = got["reference"]
    for engine, other in got.items():
        assert other[0] == ref[0], f"{engine}: exit status"
        assert other[1] == ref[1], f"{engine}: the table"
        assert other[3] == ref[3], f"{engine}: the JSON"
    return {"status": ref[0], "out": ref[1], "err": ref[2], "json": json.loads(ref[3])}


FAULTED = [RoomPlan(1), RoomPlan(2, fault=Fault(1, 0, 5)), RoomPlan(3, fault=Fault(2, 1, 9, "decode_step")),
           RoomPlan(4)]


def test_decode_only_logs_with_live_mismatches_exit_1_and_name_the_missing_side(tmp_path, capsys):
    _, decode = live_mismatch_logs(FAULTED)
    logs = write_side(tmp_path / "decode", "decode", decode)
    got = diff(capsys, tmp_path, logs)
    assert got["status"] == 1
    # rooms 2 and 3: every record from the fault's stage on (recv+step+finish, step+finish)
    assert got["json"]["sides"] == {"missing": "prefill", "decode_rooms": 4, "prefill_rooms": 0,
                                    "live_mismatch": {"rooms": 2, "records": 5}}
    for text in (got["out"], got["err"]):
        assert "no prefill records in these logs: 4 rooms" in text
        assert "MISMATCH for 2 rooms (5 records)" in text
    assert got["out"].count("no prefill record for this room and attempt; decode said MISMATCH live") == 2


def test_decode_only_logs_without_live_mismatch_are_incomplete_input(tmp_path, capsys):
    _, decode = live_mismatch_logs([RoomPlan(1), RoomPlan(2)])
    got = diff(capsys, tmp_path, write_side(tmp_path / "decode", "decode", decode))
    assert got["status"] == 2
    assert "no prefill records in these logs: 2 rooms" in got["err"]
    assert "MISMATCH" not in got["out"]


def test_prefill_only_logs_name_the_missing_decode_side(tmp_path, capsys):
    prefill, _ = live_mismatch_logs([RoomPlan(1), RoomPlan(2), RoomPlan(3)])
    got = diff(capsys, tmp_path, write_side(tmp_path / "prefill", "prefill", prefill))
    assert got["status"] == 2
    assert got["json"]["sides"]["missing"] == "decode"
    assert "no decode records in these logs: 3 rooms" in got["out"]


def test_both_sides_say_nothing_about_sides(tmp_path, capsys):
    prefill, decode = live_mismatch_logs(FAULTED)
    got = diff(capsys, tmp_path, write_side(tmp_path / "p", "prefill", prefill),
               write_side(tmp_path / "d", "decode", decode))
    assert got["status"] == 1  # the mismatches, found by the join itself
    assert got["json"]["sides"]["missing"] is None
    assert got["json"]["sides"]["live_mismatch"] == {"rooms": 0, "records": 0}
    assert "WARNING" not in got["out"] + got["err"]


def test_both_sides_of_other_rooms_verify_nothing_and_say_so(tmp_path, capsys):
    """Prefill's logs of some rooms, decode's of others (other pods, another time): every room
    unverified. It exited 0, with no warning (found by review)."""
    prefill, _ = live_mismatch_logs([RoomPlan(1), RoomPlan(2), RoomPlan(3)])
    _, decode = live_mismatch_logs([RoomPlan(7), RoomPlan(8)])
    got = diff(capsys, tmp_path, write_side(tmp_path / "p", "prefill", prefill),
               write_side(tmp_path / "d", "decode", decode))
    assert got["status"] == 2
    assert got["json"]["sides"]["missing"] == "pairs"
    assert "no room in these logs has records of both sides: the 2 rooms decode logged and the 3" in got["out"]


def test_a_room_prefill_sent_twice_at_one_length_with_other_digests_is_judged_against_neither(tmp_path, capsys):
    """Two prefill records of one room, attempt and length, other digests (a rebootstrap
    recomputed under new weights, or two logs that disagree): the first read was kept, so
    the files' order decided between `match` and `mismatch` (found by review)."""
    prefill, decode = live_mismatch_logs([RoomPlan(1), RoomPlan(2)])
    other, _ = room_records(RoomPlan(1), seed=5)  # another send of room 1: other bytes, the same length
    first = write_side(tmp_path / "p1", "prefill", prefill)
    second = write_side(tmp_path / "p2", "prefill", [rec for rec in other if rec.get("stage") == "prefill_send"])
    decoded = write_side(tmp_path / "d", "decode", decode)
    verdicts = []
    for order in ((first, second), (second, first)):
        got = diff(capsys, tmp_path, *order, decoded)
        rooms = {room["room"]: room for room in got["json"]["rooms"]}
        verdicts.append((got["status"], {stage["verdict"] for stage in rooms["1"]["stages"]}))
        assert got["json"]["summary"]["conflicting_prefill_records"] == 1
    assert verdicts[0] == verdicts[1] == (2, {"not_comparable"})  # the logs cannot judge it: incomplete input


def test_a_long_rid_is_found_by_its_full_text(tmp_path, capsys):
    """Rids over 256 characters are cut when read; `--rid` with the full rid found no room and
    exited 2 (found by review)."""
    long_rid = "client-" + "r" * 993
    prefill, decode = live_mismatch_logs([RoomPlan(1), RoomPlan(2)])
    for rec in prefill + decode:
        if rec["room"] == "1":
            rec["rid"] = long_rid
    logs = (write_side(tmp_path / "p", "prefill", prefill), write_side(tmp_path / "d", "decode", decode))
    got = diff(capsys, tmp_path, *logs, extra=("--rid", long_rid))
    assert got["status"] == 0 and [room["room"] for room in got["json"]["rooms"]] == ["1"]


@pytest.mark.parametrize("option, value", [("--since", "nan"), ("--until", "inf"), ("--until", "1e400")])
def test_a_time_window_that_is_not_finite_is_refused(tmp_path, capsys, option, value):
    """`--since nan` compared false with every record's time: the window kept some rooms
    only, a mismatch among the others went unseen, and diff exited 0 (found by review)."""
    prefill, decode = live_mismatch_logs(FAULTED)
    logs = (write_side(tmp_path / "p", "prefill", prefill), write_side(tmp_path / "d", "decode", decode))
    with pytest.raises(SystemExit) as exited:
        run(["diff", *map(str, logs), option, value])
    assert exited.value.code == 2
    assert f"argument {option}: '{value}' is not a finite time" in capsys.readouterr().err


def test_live_mismatch_of_a_room_whose_prefill_record_is_missing_exits_1(tmp_path, capsys):
    """Both sides present, but the faulted room's prefill record is lost: decode's word stands."""
    prefill, decode = live_mismatch_logs(FAULTED)
    prefill = [r for r in prefill if r["room"] != "2"]
    got = diff(capsys, tmp_path, write_side(tmp_path / "p", "prefill", prefill),
               write_side(tmp_path / "d", "decode", decode))
    assert got["status"] == 1
    assert got["json"]["sides"]["missing"] is None
    assert got["json"]["sides"]["live_mismatch"] == {"rooms": 1, "records": 3}


def _instances(records: list[dict], name_of) -> list[dict]:
    for rec in records:
        rec["instance"] = name_of(int(rec["room"]))
    return records


def test_coverage_per_instance_in_rooms_and_bytes_with_reasons(tmp_path, capsys):
    plans = [RoomPlan(1), RoomPlan(2), RoomPlan(3, prefill=False), RoomPlan(4, signature_drift=True),
             RoomPlan(5, decode=False), RoomPlan(6, fault=Fault(0, 0, 1)), RoomPlan(7)]
    prefill, decode = live_mismatch_logs(plans)
    _instances(prefill, lambda room: "prefill-a:10")
    _instances(decode, lambda room: "decode-a:20" if room <= 4 else "decode-b:30")
    got = diff(capsys, tmp_path, write_side(tmp_path / "p", "prefill", prefill),
               write_side(tmp_path / "d", "decode", decode))
    cov = {row["instance"]: row for row in got["json"]["coverage"]}
    assert list(cov) == ["decode-a:20", "decode-b:30", "prefill-a:10"]
    a, b, p = cov["decode-a:20"], cov["decode-b:30"], cov["prefill-a:10"]
    # decode-a: rooms 1, 2 verified; 3 unverified (no prefill record); 4 not comparable
    assert (a["rooms"], a["verified_rooms"]) == (4, 2)
    assert (a["bytes"], a["verified_bytes"]) == (4 * ROOM_BYTES, 2 * ROOM_BYTES)
    assert a["not_verified"] == [
        {"outcome": "not_comparable", "reason": "layout signature differs", "rooms": 1, "bytes": ROOM_BYTES},
        {"outcome": "unverified", "reason": "no prefill record for this room and attempt", "rooms": 1,
         "bytes": ROOM_BYTES}]
    # decode-b: room 6 mismatched (verified: the digests were compared), room 7 matched
    assert (b["rooms"], b["verified_rooms"], b["verified_bytes"], b["not_verified"]) == (2, 2, 2 * ROOM_BYTES, [])
    # prefill-a: room 5, which decode never logged
    assert (p["rooms"], p["verified_rooms"]) == (1, 0)
    assert p["not_verified"] == [{"outcome": "unverified", "reason": "no decode record in these logs",
                                  "rooms": 1, "bytes": ROOM_BYTES}]
    assert all(row["rooms_of_unknown_size"] == 0 for row in cov.values())
    table = got["out"]
    assert "coverage per instance" in table
    assert "decode-a:20: verified 2 of 4 rooms (50.0%)" in table
    assert "not_comparable 1 rooms, 99.0 KiB: layout signature differs" in table


def test_coverage_of_a_layout_the_package_does_not_ship_is_of_unknown_size(tmp_path, capsys):
    prefill, decode = live_mismatch_logs([RoomPlan(1), RoomPlan(2)])
    for rec in prefill + decode:
        if rec["room"] == "2":
            rec["layout"] = "site_custom_layout"
    got = diff(capsys, tmp_path, write_side(tmp_path / "p", "prefill", prefill),
               write_side(tmp_path / "d", "decode", decode))
    (row,) = got["json"]["coverage"]
    assert (row["rooms"], row["verified_rooms"], row["rooms_of_unknown_size"]) == (2, 2, 1)
    assert row["bytes"] == row["verified_bytes"] == ROOM_BYTES
    assert "1 rooms of unknown size" in got["out"]


def test_rid_selection_writes_no_coverage(tmp_path, capsys):
    prefill, decode = live_mismatch_logs([RoomPlan(1), RoomPlan(2)])
    for rec in prefill + decode:
        rec["rid"] = f"req-{rec['room']}"
    got = diff(capsys, tmp_path, write_side(tmp_path / "p", "prefill", prefill),
               write_side(tmp_path / "d", "decode", decode), extra=("--rid", "req-1"))
    assert got["json"]["coverage"] is None
    assert "coverage per instance" not in got["out"]


def test_diff_help_documents_the_exit_status(capsys):
    with pytest.raises(SystemExit):
        run(["diff", "--help"])
    text = capsys.readouterr().out
    assert "exit status of diff" in text and "one side's" in text


def test_a_decode_digest_that_differs_from_prefill_s_is_a_mismatch_whatever_the_live_verdict_said(tmp_path, capsys):
    """A live `skipped` stands for a record without a digest (the serving side could not take
    one); a record that carries one is judged from the digests, like any other. It read
    `skipped`, exit 0, even with --strict."""
    prefill, decode = room_records(RoomPlan(2, fault=Fault(1, 0, 5)))
    for rec in decode:
        rec["verdict"] = "skipped"
    got = diff(capsys, tmp_path, write_side(tmp_path / "prefill", "prefill", prefill),
               write_side(tmp_path / "decode", "decode", decode))
    (room,) = got["json"]["rooms"]
    assert (got["status"], room["verdict"]) == (1, "mismatch")
