"""`dsv4-idxk-probe diff` on logs written by the real writer from real digests."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.support.logdata import LAYER_IDS, LAYOUT, N_TOKENS, Fault, RoomPlan, hicache_record, roundtrip_record, write_logs

from dsv4_idxk_probe.cli.main import run
from dsv4_idxk_probe.offline.join import analyse
from dsv4_idxk_probe.roomlog import encode_line
from dsv4_idxk_probe.roomlog.reader import expand_inputs


def diff(*args, json_path=None):
    argv = ["diff", *map(str, args)]
    if json_path is not None:
        argv += ["--json", str(json_path)]
    return run(argv)


def load(path):
    return json.loads(path.read_text())


def rooms_by_id(report):
    return {(r["room"], r["attempt"]): r for r in report["rooms"]}


def test_all_matching_rooms_exit_zero(logs, tmp_path, capsys):
    prefill, decode = logs([RoomPlan(i) for i in range(1, 6)])
    assert diff(prefill, decode, json_path=tmp_path / "d.json") == 0
    report = load(tmp_path / "d.json")
    assert report["exit_status"] == 0
    assert report["summary"]["room_verdicts"] == {"match": 5}
    assert report["summary"]["stage_verdicts"]["decode_step"] == {"match": 5}
    assert "rooms that did not match" not in capsys.readouterr().out


def test_mismatch_is_localised_and_its_first_stage_named(logs, tmp_path, capsys):
    fault = Fault(layer_index=2, page=1, byte=652, from_stage="decode_step")
    prefill, decode = logs([RoomPlan(1), RoomPlan(2, fault=fault, steps=(40, 80))])
    assert diff(prefill, decode, json_path=tmp_path / "d.json") == 1
    room = rooms_by_id(load(tmp_path / "d.json"))[("2", 0)]
    assert room["verdict"] == "mismatch"
    assert room["first_divergence"] == {"stage": "decode_step", "step": 40}
    assert room["last_match_before"] == {"stage": "decode_recv", "step": None}
    stages = {(s["stage"], s["step"]): s for s in room["stages"]}
    assert stages[("decode_recv", None)]["verdict"] == "match"
    where = stages[("decode_finish", None)]["localisation"]
    assert where["layers"] == [LAYER_IDS[2]] and where["pages"] == [1] and where["exact"]
    out = capsys.readouterr().out
    assert "2/0" in out and "decode_step@40" in out


def test_byte_offset_maps_to_the_right_segment(logs, tmp_path):
    payload_bytes = LAYOUT.segments[0].slot_bytes * LAYOUT.slots
    prefill, decode = logs([RoomPlan(1, fault=Fault(0, 0, 5)), RoomPlan(2, fault=Fault(0, 0, payload_bytes + 5))])
    diff(prefill, decode, json_path=tmp_path / "d.json")
    rooms = rooms_by_id(load(tmp_path / "d.json"))
    assert rooms[("1", 0)]["stages"][0]["localisation"]["segments"] == ["payload"]
    assert rooms[("2", 0)]["stages"][0]["localisation"]["segments"] == ["scale"]


@given(layer=st.integers(0, len(LAYER_IDS) - 1), page=st.integers(0, 2), byte=st.integers(0, LAYOUT.row_bytes - 1))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_single_frozen_byte_is_localised_exactly(tmp_path_factory, layer, page, byte):
    """A flipped byte in a frozen slot is found at its layer and page; an unfrozen one is not a mismatch."""
    root = tmp_path_factory.mktemp("prop")
    prefill, decode = write_logs(root, [RoomPlan(9, fault=Fault(layer, page, byte))])
    analysis = analyse(expand_inputs([str(prefill), str(decode)]))
    stage = analysis.rooms[("9", 0)].stages[0]
    seg = next(s for s in LAYOUT.segments if s.offset <= byte < s.offset + s.slot_bytes * LAYOUT.slots)
    frozen = (byte - seg.offset) // seg.slot_bytes < LAYOUT.frozen_slots(N_TOKENS, page)
    if frozen:
        assert stage.verdict == "mismatch"
        c = stage.comparison
        assert (c.layers, c.pages, c.segments, c.exact) == ([LAYER_IDS[layer]], [page], [seg.name], True)
    else:
        assert stage.verdict == "match"


def test_verdicts_are_recomputed_not_trusted(logs, tmp_path):
    """Decode wrote "match" live, but its digest differs from prefill's."""
    prefill, decode = logs([RoomPlan(1, fault=Fault(1, 0, 0))])
    assert diff(prefill, decode, json_path=tmp_path / "d.json") == 1
    summary = load(tmp_path / "d.json")["summary"]
    assert summary["room_verdicts"] == {"mismatch": 1}
    assert summary["live_verdict_disagreements"] == 3  # recv, step, finish


def test_unverified_not_comparable_and_prefill_only(logs, tmp_path):
    plans = [RoomPlan(1), RoomPlan(2, prefill=False), RoomPlan(3, signature_drift=True), RoomPlan(4, decode=False)]
    prefill, decode = logs(plans)
    assert diff(prefill, decode, json_path=tmp_path / "d.json") == 0
    assert diff(prefill, decode, "--strict") == 1
    report = load(tmp_path / "d.json")
    rooms = rooms_by_id(report)
    assert rooms[("2", 0)]["verdict"] == "unverified"
    assert rooms[("3", 0)]["verdict"] == "not_comparable"
    assert ("4", 0) not in rooms and report["summary"]["prefill_only_rooms"] == 1
    assert report["prefill_only"] == [{"room": "4", "attempt": 0, "verdict": "unverified",
                                       "reason": "prefill sent it; no decode record in these logs"}]


def test_rooms_decode_never_finished_are_counted_and_marked(logs, tmp_path):
    """A room whose decode_finish is missing (decode died, or logs cut early) is not silently "match"."""
    prefill, decode = logs([RoomPlan(1), RoomPlan(2)])
    for f in decode.glob("*.jsonl"):
        kept = [line for line in f.read_text().splitlines(keepends=True)
                if not ('"room":"2"' in line.replace(" ", "") and "decode_finish" in line)]
        f.write_text("".join(kept))
    assert diff(prefill, decode, json_path=tmp_path / "d.json") == 0
    report = load(tmp_path / "d.json")
    rooms = rooms_by_id(report)
    assert report["summary"]["rooms_without_decode_finish"] == 1
    assert (rooms[("2", 0)]["closed"], rooms[("1", 0)]["closed"]) == (False, True)


def test_attempts_are_joined_separately(logs, tmp_path):
    prefill, decode = logs([RoomPlan(5, attempt=0, fault=Fault(0, 0, 0)), RoomPlan(5, attempt=1)])
    diff(prefill, decode, json_path=tmp_path / "d.json")
    rooms = rooms_by_id(load(tmp_path / "d.json"))
    assert rooms[("5", 0)]["verdict"] == "mismatch" and rooms[("5", 1)]["verdict"] == "match"


def test_input_order_and_rotation_do_not_change_the_answer(logs, tmp_path):
    plans = [RoomPlan(i, fault=Fault(1, 2, 3, "decode_finish") if i % 3 == 0 else None) for i in range(1, 13)]
    prefill, decode = logs(plans, max_bytes=6000)
    assert len(list(decode.glob("*.jsonl.gz"))) >= 2, "the test needs rotated, gzipped files"
    assert diff(prefill, decode, json_path=tmp_path / "a.json") == 1
    assert diff(str(decode / "*.jsonl*"), prefill, json_path=tmp_path / "b.json") == 1
    a, b = load(tmp_path / "a.json"), load(tmp_path / "b.json")
    assert a["summary"] == b["summary"]
    assert a["summary"]["room_verdicts"] == {"match": 8, "mismatch": 4}
    assert a["summary"]["first_divergence"] == {"decode_finish": 4}


def test_bad_lines_are_reported_by_file_and_line_and_skipped(logs, tmp_path, capsys, caplog):
    prefill, decode = logs([RoomPlan(1), RoomPlan(2)])
    path = next(decode.glob("*.jsonl"))
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"attempt":0', b'"attempt":1')  # edited by hand
    lines.insert(3, encode_line({"v": 1, "kind": "room", "room": "7", "attempt": "zero", "stage": "decode_recv"}))
    lines.insert(4, encode_line({"v": 99, "kind": "room"}))
    path.write_bytes(b"".join(lines) + b'{"v":1,"kind":"ro')  # and a torn last line
    assert diff(prefill, decode, json_path=tmp_path / "d.json") == 2
    err = capsys.readouterr().err
    assert f"{path}:2: line checksum does not match" in err
    assert f"{path}:4: attempt must be a non-negative integer" in err
    assert f"{path}:5: v must be 1" in err
    # a crash's last line is skipped and said, not counted bad
    assert f"{path}:{len(lines) + 1}: torn final line" in caplog.text
    report = load(tmp_path / "d.json")
    assert report["summary"]["bad_lines"] == 3
    assert report["summary"]["room_verdicts"] == {"match": 2}


def test_a_mismatch_outranks_bad_lines(logs, tmp_path):
    prefill, decode = logs([RoomPlan(1, fault=Fault(0, 0, 0))])
    with open(next(decode.glob("*.jsonl")), "ab") as f:
        f.write(b"garbage\n")
    assert diff(prefill, decode) == 1


def test_malformed_digest_names_the_field(logs, tmp_path, capsys):
    prefill, decode = logs([RoomPlan(1)])
    from tests.support.logdata import room_records

    _, dec = room_records(RoomPlan(1))
    rec = dec[0]
    rec["digest"]["pages"][0] = "not-hex-at-all!!"
    path = decode / "extra.jsonl"
    path.write_bytes(encode_line(rec))
    assert diff(prefill, decode) == 2
    assert f"{path}:1: digest.pages must be" in capsys.readouterr().err


@pytest.mark.parametrize("content", [b"", b"\x00\x01\x02" * 1000, b"not json at all\n" * 5, b"\x1f\x8b\x08broken gzip"])
def test_hostile_input_files_exit_two_without_traceback(tmp_path, content):
    path = tmp_path / "weird.jsonl"
    path.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "dsv4_idxk_probe", "diff", str(path)], capture_output=True, timeout=60)
    assert proc.returncode == 2
    assert b"Traceback" not in proc.stderr + proc.stdout


def test_missing_input_exits_two_with_its_name(tmp_path, capsys):
    assert diff(tmp_path / "nope.jsonl") == 2
    assert f"{tmp_path / 'nope.jsonl'}: no such file" in capsys.readouterr().err


def test_hicache_records_are_counted_not_joined(logs, tmp_path):
    prefill, decode = logs(
        [RoomPlan(1)], extra_decode=[hicache_record("deepseek_v4_c4_indexer", "page", count=5), hicache_record("deepseek_v4_c4_indexer", "page")]
    )
    assert diff(prefill, decode, json_path=tmp_path / "d.json") == 0
    summary = load(tmp_path / "d.json")["summary"]
    assert summary["records"] == {"room": 4, "hicache": 2}
    assert summary["hicache_branches"] == [{"pool": "deepseek_v4_c4_indexer", "direction": "d2h", "branch": "page", "count": 6}]
    assert summary["rooms"] == 1


def test_a_hicache_round_trip_diagnosis_is_a_finding_named_with_its_load(logs, tmp_path, capsys):
    """Prefill's PD digest covers a host row broken before its load (both sides digest the same
    bytes), so only round-trip mode sees it: diff says so, names the row, and exits 1."""
    prefill, decode = logs([RoomPlan(1)], extra_decode=[roundtrip_record()])
    assert diff(prefill, decode, json_path=tmp_path / "d.json") == 1
    out = capsys.readouterr().out
    assert "hicache round trip: 1 host row changed in host memory while resident (matched at backup), last event hicache_load" in out
    assert ("deepseek_v4_c4_indexer host row 5 layer 1: changed in host memory while resident (matched at backup); "
            "loaded into device page 6, last event hicache_load") in out
    summary = load(tmp_path / "d.json")["summary"]
    assert summary["room_verdicts"] == {"match": 1}
    (row,) = summary["hicache_roundtrip"]["rows"]
    assert summary["hicache_roundtrip"]["mismatches"] == 1
    assert (row["host_row"], row["device_page"], row["leg"], row["checks"]["d2h"]) == (5, 6, "host", "match")
    assert row["events"][-1]["host_row_checks"] == {"d2h": "match", "host": "mismatch", "h2d": "match", "layers": [1]}


@pytest.mark.parametrize("edit, field", [
    (lambda r: r.update(host_row="5"), "host_row"),
    (lambda r: r.update(leg="disk"), "leg"),
    (lambda r: r["checks"].update(host="bad"), "checks"),
    (lambda r: r["events"][1]["host_row_checks"].update(layers="all"), "events[1].host_row_checks.layers"),
])
def test_a_malformed_round_trip_diagnosis_is_a_bad_line_naming_the_field(logs, tmp_path, capsys, edit, field):
    rec = roundtrip_record()
    edit(rec)
    prefill, decode = logs([RoomPlan(1)], extra_decode=[rec])
    assert diff(prefill, decode) == 2
    assert field in capsys.readouterr().err


def _digest():
    from tests.support.logdata import room_records

    return room_records(RoomPlan(1))[0][0]["digest"]


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda d: d.pop("pages"), "digest.pages is missing"),
        (lambda d: d.update(signature="xyz"), "digest.signature"),
        (lambda d: d.update(n_tokens=-1), "digest.n_tokens"),
        (lambda d: d.update(layer_ids="0123"), "digest.layer_ids"),
        (lambda d: d.update(segments=[]), "digest.segments"),
        (lambda d: d["layer_segment"].pop(), "digest.layer_segment"),
        (lambda d: d["layer_segment"][0].append("0" * 16), "digest.layer_segment"),
        (lambda d: d["layer_segment"][1].__setitem__(0, "0" * 15), "digest.layer_segment"),
        (lambda d: d["pages"].__setitem__(0, "0" * 15 + " "), "16-digit hex"),
        (lambda d: d["pages"].__setitem__(1, 7), "digest.pages"),
    ],
)
def test_each_malformed_digest_field_is_named(edit, field):
    from dsv4_idxk_probe.offline.validation import RecordError, pack_digest

    digest = _digest()
    pack_digest(digest)  # the untouched digest is fine
    edit(digest)
    with pytest.raises(RecordError, match=field):
        pack_digest(digest)


def test_the_log_tools_never_import_torch():
    """`diff` and `report` run where logs are read (a laptop, a CI box): the modules they
    import, diagnosis and the round-trip summaries included, leave torch alone."""
    import subprocess
    import sys

    code = ("import sys, dsv4_idxk_probe.cli.diff, dsv4_idxk_probe.cli.report; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# %% Reliability round two: a room of many records joins in linear time; clusters


def _many_records(path, n, vary):
    """One room: a prefill record, then `n` decode records without a digest, each a new
    decode step (`vary="steps"`) or a new transfer of the same step (`vary="transfers"`);
    or `n` records of one decode step, each with a digest of its own (`vary="digests"`:
    the same point observed `n` ways, every one kept and counted a conflict but the first)."""
    import copy

    from dsv4_idxk_probe.pd.records import room_record

    (prefill,), _ = room_records_for(RoomPlan(1))
    lines = [encode_line(prefill)]
    for i in range(n):
        step = i if vary == "steps" else 0
        tokens = 1000 + i if vary == "transfers" else None
        record = room_record(role="decode", stage="decode_step", room=1, attempt=0, digest=None,
                             layout=LAYOUT.name, step=step, tokens=tokens)
        if vary == "digests":
            record["digest"] = copy.deepcopy(prefill["digest"])
            record["digest"]["pages"][0] = f"{i:016x}"
        lines.append(encode_line(record))
    path.write_bytes(b"".join(lines))
    return path


def room_records_for(plan):
    from tests.support.logdata import room_records

    return room_records(plan)


@pytest.mark.parametrize("vary", ["steps", "transfers", "digests"])
def test_a_room_of_many_records_joins_in_linear_time(tmp_path, vary):
    """20,000 records of one room took 10 s, 100,000 took 327 s (each record scanned its room's
    records); 20,000 digests of one point 20 s (each new digest copied the point's set). The
    same room at n and 4n records: linear time is a ratio near 4, quadratic near 16; the bound
    is generous (timings on a shared machine), and the best of two runs is taken."""
    import time

    n = 8000 if vary == "digests" else 4000  # a set copy per digest is cheap per element: more of them
    small = _many_records(tmp_path / "small.jsonl", n, vary)
    large = _many_records(tmp_path / "large.jsonl", 4 * n, vary)

    def seconds(path):
        best = math.inf
        for _ in range(2):
            start = time.process_time()
            analysis = analyse([path])
            best = min(best, time.process_time() - start)
        stages = analysis.rooms[("1", 0)].stages
        assert len(stages) == (n if path is small else 4 * n) and analysis.duplicates == 0
        return best

    ratio = seconds(large) / seconds(small)
    assert ratio < 8, f"4x the records took {ratio:.1f}x the time (quadratic: ~16)"


def test_duplicates_in_a_long_room_are_still_found(tmp_path):
    """The index that makes the join linear still counts a duplicate as before."""
    path = _many_records(tmp_path / "d.jsonl", 100, "steps")
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines + lines[1:]))  # every decode record twice
    analysis = analyse([path])
    assert len(analysis.rooms[("1", 0)].stages) == 100 and analysis.duplicates == 100


def test_a_decode_record_with_another_digest_is_judged_not_dropped_as_a_duplicate(tmp_path):
    """A duplicate is the same record read twice (docs/roomlog.md). A second record of the same
    decode stage with another digest, here one that mismatches prefill's, was counted as a
    duplicate and dropped, and diff exited 0: it is judged as a stage of its own."""
    from tests.support.logdata import room_records

    prefill, decode = room_records(RoomPlan(1))
    _, corrupt = room_records(RoomPlan(1, fault=Fault(1, 1, 5)))
    assert corrupt[0]["stage"] == "decode_recv" and corrupt[0]["digest"] != decode[0]["digest"]
    (tmp_path / "p.jsonl").write_bytes(b"".join(encode_line(r) for r in prefill))
    (tmp_path / "d.jsonl").write_bytes(b"".join(encode_line(r) for r in decode))
    (tmp_path / "d-copy.jsonl").write_bytes(b"".join(encode_line(r) for r in decode))  # the same file twice
    (tmp_path / "d-other.jsonl").write_bytes(encode_line(corrupt[0]))
    assert diff(tmp_path, json_path=tmp_path / "out.json") == 1
    report = load(tmp_path / "out.json")
    assert report["summary"]["duplicate_records"] == len(decode)
    assert report["summary"]["conflicting_decode_records"] == 1  # decode_recv logged with two digests
    (room,) = report["rooms"]
    assert room["verdict"] == "mismatch" and room["first_divergence"]["stage"] == "decode_recv"
    assert [s["verdict"] for s in room["stages"] if s["stage"] == "decode_recv"] == ["match", "mismatch"]


def test_a_decode_record_with_another_digest_in_a_long_room_is_kept_too(tmp_path):
    """The same past _SCAN stages, where the room's stages are indexed."""
    from dsv4_idxk_probe.pd.records import room_record

    path = _many_records(tmp_path / "d.jsonl", 100, "steps")
    (prefill,), _ = room_records_for(RoomPlan(1))
    other = room_record(role="decode", stage="decode_step", room=1, attempt=0, digest=None,
                        layout=LAYOUT.name, step=7)
    other["digest"] = prefill["digest"]  # step 7 again, with a digest this time
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines + lines[1:] + [encode_line(other)] * 2))
    analysis = analyse([path])
    stages = analysis.rooms[("1", 0)].stages
    assert len(stages) == 101 and analysis.duplicates == 101
    assert analysis.decode_conflicts == 1  # step 7 without a digest, then with one (twice: one conflict)
    assert [s.verdict for s in stages if s.step == 7] == ["unverified", "match"]


def test_conflicting_decode_records_are_counted_and_printed(tmp_path, capsys):
    """Two decode logs that disagree on a point (the same stage, step and transfer, another
    digest) are each judged; the summary counts the disagreement apart from duplicates and the
    table prints it (a long room, whose stages are indexed: the test above)."""
    from tests.support.logdata import room_records

    prefill, decode = room_records(RoomPlan(1))
    _, corrupt = room_records(RoomPlan(1, fault=Fault(1, 1, 5)))
    _, other = room_records(RoomPlan(1, fault=Fault(1, 2, 9)))
    (tmp_path / "p.jsonl").write_bytes(b"".join(encode_line(r) for r in prefill))
    (tmp_path / "d.jsonl").write_bytes(b"".join(encode_line(r) for r in decode))
    (tmp_path / "d-2.jsonl").write_bytes(encode_line(corrupt[0]) * 2)  # one conflict, then its duplicate
    (tmp_path / "d-3.jsonl").write_bytes(encode_line(other[0]))  # a third digest at the same point
    assert diff(tmp_path, json_path=tmp_path / "out.json") == 1
    summary = load(tmp_path / "out.json")["summary"]
    assert (summary["conflicting_decode_records"], summary["duplicate_records"]) == (2, 1)
    assert "conflicting decode records 2;" in capsys.readouterr().out


def _cluster_logs(tmp_path, labelled):
    """Room 1 in two clusters, each its own (different) index-K bytes and decode steps, both intact."""
    paths = []
    for seed, cluster, steps in ((0, "eu-1", (40,)), (7, "us-2", (80,))):
        from tests.support.logdata import room_records

        prefill, decode = room_records(RoomPlan(1, steps=steps), seed=seed)
        for rec in prefill + decode:
            if labelled:
                rec["cluster"] = cluster
        paths.append(tmp_path / f"{cluster}.jsonl")
        paths[-1].write_bytes(b"".join(encode_line(r) for r in prefill + decode))
    return paths


def test_the_same_room_id_from_two_clusters_is_two_rooms_not_a_mismatch(tmp_path, capsys):
    paths = _cluster_logs(tmp_path, labelled=True)
    out = tmp_path / "d.json"
    assert diff(*paths, json_path=out) == 0
    report = load(out)
    assert report["summary"]["room_verdicts"] == {"match": 2}
    assert report["summary"]["conflicting_prefill_records"] == 0
    assert sorted(r["cluster"] for r in report["rooms"]) == ["eu-1", "us-2"]


def test_without_cluster_labels_the_two_clusters_still_collide(tmp_path):
    """What the label is for: unlabelled, the second cluster's prefill record conflicts, and
    the room is judged against neither record (which one a decode record belongs to is not in
    the logs; it was judged against the first read, a mismatch or a match by the files' order):
    not comparable, and the logs are incomplete input (exit 2)."""
    paths = _cluster_logs(tmp_path, labelled=False)
    assert diff(*paths, json_path=tmp_path / "d.json") == 2
    summary = load(tmp_path / "d.json")["summary"]
    assert summary["conflicting_prefill_records"] == 1 and summary["room_verdicts"] == {"not_comparable": 1}


def test_a_cluster_label_from_the_config_is_written_in_every_room_record():
    from dsv4_idxk_probe.config import ConfigError, parse_config
    from dsv4_idxk_probe.pd import records

    assert parse_config({}, "<t>").roomlog.cluster == ""
    assert parse_config({"roomlog": {"cluster": "eu-1"}}, "<t>").roomlog.cluster == "eu-1"
    with pytest.raises(ConfigError, match="roomlog.cluster"):
        parse_config({"roomlog": {"cluster": "a\x1b[2J"}}, "<t>")
    prefill, _ = room_records_for(RoomPlan(1))
    assert "cluster" not in prefill[0]  # no label, no field: the lines stay as they were
    try:
        records.set_cluster("eu-1")
        (labelled,), _ = room_records_for(RoomPlan(1))
        assert labelled["cluster"] == "eu-1"
    finally:
        records.set_cluster("")


def test_a_prefill_only_room_keeps_its_cluster_in_the_json(tmp_path):
    from tests.support.logdata import room_records

    prefill, _ = room_records(RoomPlan(1))
    prefill[0]["cluster"] = "eu-1"
    path = tmp_path / "p.jsonl"
    path.write_bytes(encode_line(prefill[0]))
    diff(path, json_path=tmp_path / "d.json")
    assert load(tmp_path / "d.json")["prefill_only"][0]["cluster"] == "eu-1"


def _unlocalised(room, steps, n=64, attempt=0):
    """Room `room`: a prefill record and one decode_step per step whose digest differs in all
    n layers x n pages, logged with decode's empty diagnosis and no localisation: the join's
    bound is n*n cells, each completed as `unknown` (4,096 for n=64)."""
    def digest(cell, page):
        return {"key": "x", "signature": "00000000000000aa", "n_tokens": 256, "layer_ids": list(range(n)),
                "segments": ["k"], "room": "0" * 16, "layer_segment": [[cell]] * n, "pages": [page] * n}

    def rec(stage, step, d, **kw):
        return {"v": 1, "kind": "room", "ts": 1.7e9, "role": "prefill" if stage == "prefill_send" else "decode",
                "instance": "h:1", "room": str(room), "attempt": attempt, "stage": stage, "step": step,
                "layout": "fp8", "digest": d, **kw}

    bad = digest("00000000000000ff", "00000000000000ff")
    return [encode_line(rec("prefill_send", None, digest("0000000000000001", "0000000000000002")))] + [
        encode_line(rec("decode_step", step, bad, verdict="mismatch", diagnosis=[])) for step in steps]


def test_an_unlocalised_mismatch_is_diagnosed_at_the_first_divergence_only(tmp_path):
    """Every such record was completed to its bound's cells and all were kept: 1,000 records of
    3 MB took 855 MB. Only the first divergence (what the table, summary and report read) is."""
    import tracemalloc

    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join(_unlocalised(1, range(40, 0, -1))))  # the first divergence is read last
    tracemalloc.start()
    try:
        analysis = analyse([path])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20, f"peak {peak >> 20} MiB"  # was 30 MiB: each completed record ~0.8 MiB
    room = analysis.rooms[("1", 0)]
    assert room.first_divergence.step == 1 and len(room.first_divergence.diagnosis) == 4096
    assert {c["kind"] for c in room.first_divergence.diagnosis} == {"unknown"}
    assert all(s.diagnosis == [] for s in room.stages if s is not room.first_divergence)


def test_the_cells_completed_in_all_are_capped_and_the_rooms_past_the_cap_counted(tmp_path, monkeypatch, caplog):
    """Many rooms of one such record each: memory stays bounded, rooms past the cap (in the
    table's order) keep decode's own cells, and a warning says how many."""
    from dsv4_idxk_probe.offline import join

    monkeypatch.setattr(join, "MAX_COMPLETED_CELLS", 2 * 16 + 8)
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join(line for room in (3, 1, 2, 10) for line in _unlocalised(room, [5], n=4)))
    analysis = analyse([path])
    cells = {k[0]: len(r.first_divergence.diagnosis) for k, r in analysis.rooms.items()}
    assert cells == {"1": 16, "2": 16, "3": 0, "10": 0}
    assert "diagnosis of 2 room(s) left as decode logged it" in caplog.text
