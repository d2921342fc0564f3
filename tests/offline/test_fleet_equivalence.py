"""The fleet engine (DuckDB) against the reference join, on every kind of log set the
observability tests use and on hostile ones: the same exit status, table and JSON, byte for byte."""

from __future__ import annotations

import copy
import gzip
import json
import shutil
from pathlib import Path

import pytest
import xxhash
from tests.support.logdata import Fault, RoomPlan, hicache_record, room_records, roundtrip_record, write_logs

from dsv4_idxk_probe.cli.main import run
from dsv4_idxk_probe.offline import fleet
from dsv4_idxk_probe.roomlog import encode_line
from dsv4_idxk_probe.roomlog.reader import expand_inputs

pytest.importorskip("duckdb")


@pytest.fixture(autouse=True, params=["table", "native", "python"])
def line_pass(request, monkeypatch):
    """Every test on the three routes: the native pass with the native room table judging
    the clean keys (`fleet/ctable.c`, `table_route`), the native pass with DuckDB judging
    them, and the pure-Python scan with DuckDB's ingest (test_fleet_native checks the
    modules are built)."""
    monkeypatch.delenv(fleet.table_route.ENV, raising=False)
    if request.param == "python":
        monkeypatch.setenv(fleet.native.ENV, "0")
    else:
        monkeypatch.delenv(fleet.native.ENV, raising=False)
        if fleet.native.module() is None or (request.param == "table" and fleet.native.ctable is None):
            pytest.skip("the native line pass or room table is not built")
        if request.param == "native":
            monkeypatch.setenv(fleet.table_route.ENV, "0")
    return request.param


def both(capsys, tmp_path, *inputs, extra=()):
    """Run `diff` with each engine; return (status, stdout, json bytes) per engine."""
    out = {}
    for engine in ("reference", "duckdb"):
        path = tmp_path / f"{engine}.json"
        status = run(["diff", *map(str, inputs), "--engine", engine, "--json", str(path), *extra])
        captured = capsys.readouterr()
        out[engine] = (status, captured.out, path.read_bytes())
    return out


def assert_same(capsys, tmp_path, *inputs, extra=()):
    got = both(capsys, tmp_path, *inputs, extra=extra)
    ref, new = got["reference"], got["duckdb"]
    assert new[0] == ref[0], "exit status"
    assert new[1] == ref[1], "the table"
    if new[2] != ref[2]:  # say where, then fail
        a, b = json.loads(ref[2]), json.loads(new[2])
        for key in a:
            assert a[key] == b.get(key), key
        assert new[2] == ref[2]
    return json.loads(ref[2])


def raw_line(body: bytes) -> bytes:
    """A line with a valid checksum around any bytes (which need not be JSON)."""
    head = body[:-1] if body.endswith(b"}") else body
    return head + b',"h":"' + xxhash.xxh64_hexdigest(head).encode() + b'"}\n'


def write(path: Path, lines: list[bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(lines))
    return path


# %% the observability tests' log sets


SETS = {
    "all match": lambda: [RoomPlan(i) for i in range(1, 6)],
    "mismatch localised": lambda: [RoomPlan(1), RoomPlan(2, fault=Fault(2, 1, 652, "decode_step"), steps=(40, 80))],
    "unverified, not comparable, prefill only": lambda: [
        RoomPlan(1), RoomPlan(2, prefill=False), RoomPlan(3, signature_drift=True), RoomPlan(4, decode=False)],
    "attempts": lambda: [RoomPlan(5, attempt=0, fault=Fault(0, 0, 0)), RoomPlan(5, attempt=1)],
    "many steps": lambda: [RoomPlan(i, steps=(32, 64, 96, 128)) for i in range(1, 4)],
    "every stage faulted": lambda: [RoomPlan(i, fault=Fault(i % 4, i % 3, i, s))
                                    for i, s in enumerate(("decode_recv", "decode_step", "decode_finish"), 1)],
}


@pytest.mark.parametrize("name", SETS)
def test_same_findings_on_the_observability_log_sets(name, tmp_path, capsys):
    prefill, decode = write_logs(tmp_path / "logs", SETS[name]())
    assert_same(capsys, tmp_path, prefill, decode)


def test_same_on_rotated_gzipped_logs_in_any_order(tmp_path, capsys):
    plans = [RoomPlan(i, fault=Fault(1, 2, 3, "decode_finish") if i % 3 == 0 else None) for i in range(1, 13)]
    prefill, decode = write_logs(tmp_path / "logs", plans, max_bytes=6000)
    assert len(list(decode.glob("*.jsonl.gz"))) >= 2
    report = assert_same(capsys, tmp_path, str(decode / "*.jsonl*"), prefill)
    assert report["summary"]["room_verdicts"] == {"match": 8, "mismatch": 4}


def test_same_with_hicache_records_and_a_round_trip_diagnosis(tmp_path, capsys):
    extra = [hicache_record("deepseek_v4_c4_indexer", "page", count=3), roundtrip_record(),
             hicache_record("deepseek_v4_c4_indexer", "empty", "h2d")]
    prefill, decode = write_logs(tmp_path / "logs", [RoomPlan(1), RoomPlan(2)], extra_decode=extra)
    report = assert_same(capsys, tmp_path, prefill, decode)
    assert report["summary"]["hicache_roundtrip"]["mismatches"] == 1


def test_same_with_rids_and_rid_selection(tmp_path, capsys):
    pre, dec = [], []
    for i in range(1, 5):
        p, d = room_records(RoomPlan(i, fault=Fault(0, 0, 0) if i == 3 else None))
        for r in p:
            r["rid"] = f"req-{i}"
        for r in d[1:]:
            r["rid"] = f"dec-{i}"
        pre += p
        dec += d
    write(tmp_path / "p" / "prefill-a-1.000001.jsonl", [encode_line(r) for r in pre])
    write(tmp_path / "d" / "decode-a-2.000001.jsonl", [encode_line(r) for r in dec])
    assert_same(capsys, tmp_path, tmp_path / "p", tmp_path / "d")
    report = assert_same(capsys, tmp_path, tmp_path / "p", tmp_path / "d", extra=("--rid", "dec-2", "--rid", "req-3"))
    assert [r["room"] for r in report["rooms"]] == ["2", "3"]


# %% hostile log sets


def hostile_set(root: Path) -> list[Path]:
    """Every kind of line the fast path must not trust, among clean rooms."""
    pre, dec = [], []
    for i in range(1, 31):
        p, d = room_records(RoomPlan(i, fault=Fault(1, 1, 7) if i == 17 else None))
        pre += p
        dec += d
    lines_p = [encode_line(r) for r in pre]
    lines_d = [encode_line(r) for r in dec]
    # room 2: a duplicate key with a valid checksum (Python keeps the last value)
    lines_d[3] = raw_line(lines_d[3][: lines_d[3].rindex(b',"h":')] + b',"room":"99"}')
    # room 3: NaN and a trailing comma in a key the reference does not read
    lines_d[6] = raw_line(lines_d[6][: lines_d[6].rindex(b',"h":')] + b',"zz":[NaN,]}')
    # room 4: a key missing and an unknown key of the same length (no NaN)
    body = lines_d[9][: lines_d[9].rindex(b',"h":')].replace(b',"first_divergence":null', b'')
    lines_d[9] = raw_line(body + b',"xx_divergence_x":1}')
    # room 5: keys in another order
    rec = dict(reversed(list(dec[12].items())))
    lines_d[12] = encode_line(rec)
    # room 6: whitespace
    lines_d[15] = raw_line(lines_d[15][: lines_d[15].rindex(b',"h":')].replace(b'"attempt":0', b'"attempt": 0') + b"}")
    # room 7: attempt written as a float, step as an exponent
    lines_d[18] = raw_line(lines_d[18][: lines_d[18].rindex(b',"h":')].replace(b'"attempt":0', b'"attempt":0.0') + b"}")
    # room 8: an escaped room id that reads the same, and one with a lone surrogate
    lines_d[21] = raw_line(lines_d[21][: lines_d[21].rindex(b',"h":')].replace(b'"room":"8"', b'"room":"\\u0038"') + b"}")
    lines_p[8] = raw_line(lines_p[8][: lines_p[8].rindex(b',"h":')].replace(b'"room":"9"', b'"room":"9\\ud800"') + b"}")
    # room 10: prefill digest with an uppercase hex cell (packs equal to decode's lowercase)
    body = lines_p[9][: lines_p[9].rindex(b',"h":')]
    start = body.index(b'"pages":["') + len(b'"pages":["')
    lines_p[9] = raw_line(body[:start] + body[start:start + 16].upper() + body[start + 16:] + b"}")
    # room 11: the digest's fold changed (not read by the comparison)
    r = copy.deepcopy(pre[10])
    r["digest"]["room"] = "0" * 16
    lines_p[10] = encode_line(r)
    # room 12: a duplicate prefill record, and a conflicting one
    r = copy.deepcopy(pre[11])
    r["digest"]["pages"][0] = "f" * 16
    lines_p.append(encode_line(r))
    dup_p = [lines_p[11]]  # the duplicate in a file of its own (a line twice in one file: the reference reads it)
    # room 13: decode's digest with a row too many (malformed: a named bad line)
    r = copy.deepcopy(dec[36])
    r["digest"]["layer_segment"].append(r["digest"]["layer_segment"][0])
    lines_d[36] = encode_line(r)
    # room 14: a rebootstrapped transfer (more tokens), room 15: decode without digest
    r = copy.deepcopy(dec[39])
    r["digest"]["n_tokens"] += 256
    r["stage"], r["step"] = "decode_step", 999
    lines_d.append(encode_line(r))
    r = copy.deepcopy(dec[42])
    r["digest"], r["tokens"] = None, 600
    lines_d[42] = encode_line(r)
    # room 16: live verdict says mismatch though the digests match; room 18 skipped live
    r = copy.deepcopy(dec[45])
    r["verdict"] = "mismatch"
    lines_d[45] = encode_line(r)
    r = copy.deepcopy(dec[51])
    r["verdict"], r["digest"] = "skipped", None
    lines_d[51] = encode_line(r)
    # room 19: a diagnosis the decode side made
    r = copy.deepcopy(dec[54])
    r["diagnosis"] = [{"layer": 0, "page": 0, "segment": "payload", "kind": "zeroed"}]
    lines_d[54] = encode_line(r)
    # room 20: an extra field
    r = copy.deepcopy(dec[57])
    r["extra"] = {"note": "x"}
    lines_d[57] = encode_line(r)
    # room 21: decode digest from another room (a real mismatch, not localised live)
    r = copy.deepcopy(dec[60])
    r["digest"] = copy.deepcopy(dec[0]["digest"])
    lines_d[60] = encode_line(r)
    # room 22: duplicate decode record; room 23: a decode record with a huge step
    dup_d = [lines_d[63], lines_d[63]]
    lines_d[66] = raw_line(lines_d[66][: lines_d[66].rindex(b',"h":')].replace(b'"step":null', b'"step":123456789012345678901234') + b"}")
    # room 24: rid empty (bad); room 25: rid non-ASCII
    r = copy.deepcopy(dec[69])
    r["rid"] = ""
    lines_d[69] = encode_line(r)
    r = copy.deepcopy(dec[72])
    r["rid"] = "réq\u2028-25"
    lines_d[72] = encode_line(r)
    # room 26: bytes that are not UTF-8 inside a string; room 27: a NUL; room 28: a CR inside
    lines_d[75] = raw_line(lines_d[75][: lines_d[75].rindex(b',"h":')].replace(b'"reason":""', b'"reason":"\xff\xfe"') + b"}")
    lines_d[78] = raw_line(lines_d[78][: lines_d[78].rindex(b',"h":')].replace(b'"reason":""', b'"reason":"\x00"') + b"}")
    lines_d[81] = raw_line(lines_d[81][: lines_d[81].rindex(b',"h":')].replace(b',"reason":""', b',\r"reason":""') + b"}")
    # garbage with a valid checksum, an edited line, an empty line
    lines_d.append(raw_line(b'{"v":1,"kind":"room","room":[1],"attempt":0}'))
    lines_d.append(raw_line(b'not json at all}'))
    paths = [write(root / "p" / "prefill-h-1.000001.jsonl", lines_p),
             write(root / "d" / "decode-h-2.000001.jsonl", lines_d)]
    write(root / "p" / "prefill-h-9.000001.jsonl", dup_p)
    write(root / "d" / "decode-h-9.000001.jsonl", dup_d)
    # a second decode file with bad lines (checksum, empty, torn): read by the reference reader
    p2, d2 = room_records(RoomPlan(40))
    bad = [encode_line(r) for r in d2]
    bad.insert(1, encode_line(d2[0]).replace(b'"attempt":0', b'"attempt":1'))
    bad.insert(2, b"\n")
    paths.append(write(root / "d" / "decode-h-3.000001.jsonl", bad + [b'{"v":1,"kind":"ro']))
    write(root / "p" / "prefill-h-4.000001.jsonl", [encode_line(r) for r in p2])
    # gzipped, and a gzip named .jsonl; a file with CRLF line ends
    p3, d3 = room_records(RoomPlan(41))
    (root / "d" / "decode-h-5.000001.jsonl.gz").write_bytes(gzip.compress(b"".join(encode_line(r) for r in d3)))
    (root / "p" / "prefill-h-6.000001.jsonl").write_bytes(gzip.compress(b"".join(encode_line(r) for r in p3)))
    p4, d4 = room_records(RoomPlan(42))
    write(root / "d" / "decode-h-7.000001.jsonl", [encode_line(r).replace(b"\n", b"\r\n") for r in d4])
    write(root / "p" / "prefill-h-8.000001.jsonl", [encode_line(r) for r in p4])
    return [root / "p", root / "d"]


def test_same_findings_on_hostile_lines(tmp_path, capsys):
    inputs = hostile_set(tmp_path / "logs")
    report = assert_same(capsys, tmp_path, *inputs)
    assert report["summary"]["bad_lines"] > 0
    assert report["summary"]["room_verdicts"]["mismatch"] >= 2


def test_hostile_lines_go_to_the_reference_not_the_fast_path(tmp_path, line_pass):
    inputs = hostile_set(tmp_path / "logs")
    analysis = fleet.analyse_fleet(expand_inputs(map(str, inputs)))
    try:
        s = analysis.stats
        # the file with bad lines, the CRLF one, and on the Python scan the line written twice
        # (the native pass numbers lines itself: a line twice is two canonical records)
        assert s.slow_files >= (3 if line_pass == "python" else 2)
        assert s.odd_lines >= 10
        assert s.clean_keys >= 5 and s.complex_keys >= 20
        assert (s.clean_judge == "room table") == (line_pass == "table"), s.clean_judge
    finally:
        analysis.close()


def test_a_changed_digest_is_a_mismatch_in_both_engines(tmp_path, capsys):
    pre, dec = [], []
    for i in range(1, 21):
        p, d = room_records(RoomPlan(i))
        pre += p
        dec += d
    write(tmp_path / "p" / "prefill-x-1.000001.jsonl", [encode_line(r) for r in pre])
    good = write(tmp_path / "d" / "decode-x-2.000001.jsonl", [encode_line(r) for r in dec])
    report = assert_same(capsys, tmp_path, tmp_path / "p", tmp_path / "d")
    assert report["summary"]["room_verdicts"] == {"match": 20} and report["exit_status"] == 0
    r = copy.deepcopy(dec[3 * 7 + 2])  # room 8's decode_finish
    cell = r["digest"]["layer_segment"][1][0]
    r["digest"]["layer_segment"][1][0] = f"{int(cell, 16) ^ 1:016x}"
    r["digest"]["pages"][2] = f"{int(r['digest']['pages'][2], 16) ^ 1:016x}"
    lines = [encode_line(x) for x in dec]
    lines[3 * 7 + 2] = encode_line(r)
    good.write_bytes(b"".join(lines))
    report = assert_same(capsys, tmp_path, tmp_path / "p", tmp_path / "d")
    assert report["summary"]["room_verdicts"] == {"match": 19, "mismatch": 1} and report["exit_status"] == 1
    bad = [room for room in report["rooms"] if room["verdict"] == "mismatch"]
    assert [room["room"] for room in bad] == ["8"]
    assert bad[0]["first_divergence"] == {"stage": "decode_finish", "step": None}
    loc = bad[0]["stages"][-1]["localisation"]
    assert loc["pages"] == [2] and loc["exact"]


def test_the_same_file_twice_and_a_file_named_by_two_paths(tmp_path, capsys):
    prefill, decode = write_logs(tmp_path / "logs", [RoomPlan(1), RoomPlan(2, fault=Fault(0, 0, 0))])
    shutil.copytree(decode, tmp_path / "copy")
    assert_same(capsys, tmp_path, prefill, decode, tmp_path / "copy")
    assert_same(capsys, tmp_path, prefill, decode, str(decode / "*"))


def test_many_files_cross_batches(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(fleet.pipeline, "BATCH_FILES", 3)
    monkeypatch.setattr(fleet.pipeline, "BATCH_ROWS", 20)
    plans = [RoomPlan(i, fault=Fault(0, 1, 2) if i % 7 == 0 else None) for i in range(1, 40)]
    prefill, decode = write_logs(tmp_path / "logs", plans, max_bytes=5000, gzip_rotated=False)
    assert len(list(decode.glob("*.jsonl"))) > 6
    assert_same(capsys, tmp_path, prefill, decode)


# %% the other observability tests' sets: hostile text, clusters, many records in a room


def test_same_on_logs_with_terminal_escapes_and_bidi_controls(tmp_path, capsys):
    from tests.observability.test_hostile_logs import _hostile_logs

    logs = _hostile_logs(tmp_path / "logs")
    # and clean rooms (judged in SQL) whose rids hold C1 and bidi controls, in a file whose name does
    pre, dec = [], []
    for i in (7, 8):
        p, d = room_records(RoomPlan(i))
        for r in p + d:
            r["rid"] = f"rid\u202e\x9b{i}\u2066"
        pre += p
        dec += d
    write(logs / "p2\u202e.jsonl", [encode_line(r) for r in pre])
    write(logs / "d2\x9b.jsonl", [encode_line(r) for r in dec])
    assert_same(capsys, tmp_path, logs)


@pytest.mark.parametrize("labelled", [True, False])
def test_same_on_two_clusters_labelled_or_not(tmp_path, capsys, labelled):
    from tests.observability.test_diff import _cluster_logs

    paths = _cluster_logs(tmp_path, labelled=labelled)
    assert_same(capsys, tmp_path, *paths)


@pytest.mark.parametrize("vary", ["steps", "transfers"])
def test_same_on_a_room_of_many_records(tmp_path, capsys, vary):
    from tests.observability.test_diff import _many_records

    path = _many_records(tmp_path / "many.jsonl", 300, vary)
    assert_same(capsys, tmp_path, path)


def test_same_coverage_and_sides_with_odd_instances_and_layouts(tmp_path, capsys):
    """Coverage per instance and the sides check, from SQL-judged and Python-judged keys alike:
    instances null, missing or not text, layouts unknown or null, prefill-only and decode-only keys."""
    from dsv4_idxk_probe.roomlog import RoomLogWriter

    plans = [RoomPlan(i, prefill=i != 4, decode=i != 5, fault=Fault(0, 0, 1) if i == 6 else None) for i in range(1, 9)]
    prefill, decode = [], []
    for plan in plans:
        pre, dec = room_records(plan)
        prefill += pre
        decode += dec
    for rec in prefill + decode:
        room = int(rec["room"])
        rec["instance"] = {1: None, 2: 7, 3: ""}.get(room, f"pod-{room % 2}:1")
        if room == 7:
            rec["layout"] = "not-shipped"
        if room == 8:
            rec["layout"] = None
    for role, records in (("prefill", prefill), ("decode", decode)):
        writer = RoomLogWriter(tmp_path / "logs" / role, role, max_files=100)
        for rec in records:
            assert writer.emit(rec)
        writer.close()
    doc = assert_same(capsys, tmp_path, tmp_path / "logs" / "prefill", tmp_path / "logs" / "decode")
    assert {row["instance"] for row in doc["coverage"]} >= {"", "pod-0:1", "pod-1:1"}
    assert sum(row["rooms_of_unknown_size"] for row in doc["coverage"]) >= 2
    assert doc["sides"]["missing"] is None


def test_same_findings_on_a_decode_record_with_another_digest(tmp_path, capsys):
    """Room 1's decode_recv twice, the second with a mismatching digest: a second observation
    judged on its own, not a duplicate, on every route (the key leaves the fast path: its
    decode digests differ); room 2's decode file read twice is the duplicates."""
    root = tmp_path / "logs"
    p1, d1 = room_records(RoomPlan(1))
    _, corrupt = room_records(RoomPlan(1, fault=Fault(1, 1, 5)))
    p2, d2 = room_records(RoomPlan(2))
    write(root / "prefill-a-1.000001.jsonl", [encode_line(r) for r in p1 + p2])
    write(root / "decode-b-1.000001.jsonl", [encode_line(r) for r in d1 + d2])
    write(root / "decode-c-1.000001.jsonl", [encode_line(corrupt[0])] + [encode_line(r) for r in d2])
    report = assert_same(capsys, tmp_path, root)
    assert report["summary"]["room_verdicts"] == {"mismatch": 1, "match": 1}
    assert report["summary"]["duplicate_records"] == len(d2)
    assert report["summary"]["conflicting_decode_records"] == 1


# %% bounds both engines keep alike


def test_same_json_for_prefill_only_rooms_that_name_a_cluster(tmp_path, capsys):
    """Keys are (room, attempt, cluster) when records carry a cluster: a room decode never
    logged is written with its cluster and rid, as the reference writes it (the fleet writer
    unpacked the key as (room, attempt) and crashed)."""
    pre, dec = [], []
    for i in (1, 2, 3):
        p, d = room_records(RoomPlan(i, decode=i != 2))
        for rec in p + d:
            rec["cluster"] = "east" if i != 3 else ""
            rec["rid"] = f"req-{i}"
        pre += p
        dec += d
    write(tmp_path / "logs" / "prefill-a-1.000001.jsonl", [encode_line(r) for r in pre])
    write(tmp_path / "logs" / "decode-a-1.000001.jsonl", [encode_line(r) for r in dec])
    report = assert_same(capsys, tmp_path, tmp_path / "logs")
    assert report["prefill_only"] == [{"room": "2", "attempt": 0, "verdict": "unverified",
                                       "reason": "prefill sent it; no decode record in these logs",
                                       "cluster": "east", "rid": {"prefill": "req-2", "decode": None}}]


@pytest.mark.parametrize("attempt", [2**63, 2**64 - 1])
def test_an_attempt_past_int64_is_a_named_bad_line_in_both_engines(tmp_path, capsys, attempt):
    """The fleet engine keeps attempts as BIGINTs: past them it crashed (exit 3); validation
    refuses them, so both engines name the file:line and skip it."""
    pre, dec = room_records(RoomPlan(1))
    p2, d2 = room_records(RoomPlan(2))
    for rec in p2 + d2:
        rec["attempt"] = attempt
    path = write(tmp_path / "logs" / "a.jsonl", [encode_line(r) for r in pre + dec + p2 + d2])
    report = assert_same(capsys, tmp_path, path)
    assert report["exit_status"] == 2
    assert report["summary"]["bad_lines"] == len(p2 + d2)
    assert report["errors"][0] == f"{path}:{len(pre + dec) + 1}: attempt must be a non-negative integer below 2**63"
    assert report["summary"]["room_verdicts"] == {"match": 1}


@pytest.mark.parametrize("field", ["instance", "segments"])
def test_long_instances_and_segment_names_are_named_bad_lines_in_both_engines(tmp_path, capsys, field):
    """A 1 MiB instance or digest segment name was kept per room and printed whole (7 MiB
    strings made diff use 600 MiB and print 300 MB); over 256 characters the line is refused
    with its file:line, in both engines; 256 characters are still read (room 2, clean)."""
    rooms = {1: "x" * (1 << 20), 2: "y" * 256, 3: "z" * 257, 4: None}
    lines = []
    for i, name in rooms.items():
        p, d = room_records(RoomPlan(i))
        for rec in p + d:
            if name is not None and field == "instance":
                rec["instance"] = name
            elif name is not None:
                rec["digest"]["segments"][0] = name
        lines += [encode_line(r) for r in p + d]
    path = write(tmp_path / "logs" / "a.jsonl", lines)
    report = assert_same(capsys, tmp_path, path)
    per_room = len(lines) // len(rooms)
    assert report["summary"]["bad_lines"] == 2 * per_room
    message = ("instance must be at most 256 characters" if field == "instance"
               else "digest.segments must be names of at most 256 characters")
    assert report["errors"][0] == f"{path}:1: {message}"
    assert report["errors"][per_room] == f"{path}:{2 * per_room + 1}: {message}"
    assert report["summary"]["room_verdicts"] == {"match": 2}
    out = both(capsys, tmp_path, path)
    assert max(len(out[e][1]) + len(out[e][2]) for e in out) < 64 << 10  # nothing of the 1 MiB name


def test_long_rids_are_cut_as_the_reference_cuts_them(tmp_path, capsys):
    """A rid over 256 characters is cut when read, with a marker (ridcap.cap_rid): the fleet
    engine printed it whole, from the fast path (room 2, clean) and the Python join (room 1,
    a mismatch) alike; 256 characters stay whole (room 3)."""
    pre, dec = [], []
    for i, rid in ((1, "Q" * 5000), (2, "R" * 5000), (3, "S" * 256), (4, "T" * 257)):
        p, d = room_records(RoomPlan(i, fault=Fault(1, 1, 3) if i == 1 else None))
        for rec in p + d:
            rec["rid"] = rid
        pre += p
        dec += d
    write(tmp_path / "logs" / "prefill-a-1.000001.jsonl", [encode_line(r) for r in pre])
    write(tmp_path / "logs" / "decode-a-1.000001.jsonl", [encode_line(r) for r in dec])
    report = assert_same(capsys, tmp_path, tmp_path / "logs")
    rids = {r["room"]: r["rid"] for r in report["rooms"]}
    cut = "... (rid cut to 256 characters; 5,000 characters in the log)"
    assert rids["1"]["prefill"] == rids["1"]["decode"] == "Q" * 256 + cut
    assert rids["2"]["decode"] == "R" * 256 + cut
    assert rids["3"] == {"prefill": "S" * 256, "decode": "S" * 256}
    assert rids["4"]["prefill"].startswith("T" * 256 + "... (rid cut")
    assert report["summary"]["room_verdicts"] == {"mismatch": 1, "match": 3}
