"""Issue 17's room-log inputs: lines whose own checksum is valid but whose fields are not,
incomparable digests, names no output can print, huge lines, and the CLI rules around them."""

from __future__ import annotations

import copy
import gzip
import json
import os
import subprocess
import re
import sys
from pathlib import Path

import pytest
from tests.support.logdata import LAYER_IDS, LAYOUT, N_TOKENS, Fault, RoomPlan, room_records

from dsv4_idxk_probe.cli.main import run
from dsv4_idxk_probe.digest.reference import digest_room
from dsv4_idxk_probe.pd.records import room_record
from dsv4_idxk_probe.roomlog import encode_line
from dsv4_idxk_probe.roomlog.writer import RoomLogWriter

ROOT = Path(__file__).resolve().parents[2]


def write_lines(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(encode_line(r) for r in records))
    return path


def one_room(room: int = 1):
    prefill, decode = room_records(RoomPlan(room))
    return prefill, decode


@pytest.mark.parametrize("field, value, message", [
    ("stage", ["decode_recv"], "stage must be one of"),
    ("stage", {"a": 1}, "stage must be one of"),
    ("verdict", ["match"], "verdict must be null or one of"),
    ("verdict", {"v": "match"}, "verdict must be null or one of"),
    ("kind", ["room"], "kind must be a string, got ['room']"),
    ("ts", 1e300, "ts must be null or a Unix time in seconds"),
    ("ts", -5, "ts must be null or a Unix time in seconds"),
    ("v", [1], "v must be 1"),
    ("attempt", 2**70, "attempt must be"),
])
def test_valid_checksum_bad_field_is_a_named_bad_line_exit_2(tmp_path, capsys, field, value, message):
    prefill, decode = one_room()
    bad = copy.deepcopy(decode[0])
    bad[field] = value
    if field == "attempt":
        bad[field] = 7  # orjson refuses ints past 64 bits; a huge one goes through the stdlib as a float
        line = encode_line(bad).replace(b'"attempt":7', b'"attempt":' + str(value).encode())
        (tmp_path / "p.jsonl").write_bytes(b"".join(encode_line(r) for r in prefill))
        (tmp_path / "d.jsonl").write_bytes(line)  # checksum now broken: still a named bad line
    else:
        write_lines(tmp_path / "p.jsonl", prefill)
        write_lines(tmp_path / "d.jsonl", [*decode, bad])
    status = run(["diff", str(tmp_path / "p.jsonl"), str(tmp_path / "d.jsonl")])
    err = capsys.readouterr().err
    assert status == 2
    assert "Traceback" not in err
    if field != "attempt":
        assert message in err and "d.jsonl:4:" in err


@pytest.mark.parametrize("where, value", [
    ("layer_ids", [[1], 3]), ("layer_ids", [{"a": 1}, 3]), ("segments", [["payload"]]), ("segments", [{"x": 1}]),
])
def test_digest_items_that_are_lists_or_dicts_are_named(tmp_path, capsys, where, value):
    prefill, decode = one_room()
    bad = copy.deepcopy(decode[0])
    bad["digest"][where] = value
    write_lines(tmp_path / "p.jsonl", prefill)
    write_lines(tmp_path / "d.jsonl", [bad])
    assert run(["diff", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"digest.{where} must be a" in err and "Traceback" not in err


def _decode_with_layers(layer_ids, room=1):
    import numpy as np

    rng = np.random.default_rng(room)
    n_pages = -(-N_TOKENS // LAYOUT.page_tokens)
    buffers = [rng.integers(0, 256, size=(n_pages, LAYOUT.row_bytes), dtype=np.uint8) for _ in layer_ids]
    digest = digest_room(buffers, list(range(n_pages)), N_TOKENS, LAYOUT, tuple(layer_ids), key=f"{room}/0")
    return room_record(role="decode", stage="decode_recv", room=room, attempt=0, digest=digest,
                       layout=LAYOUT.name, verdict="match")


def test_compare_calls_equal_signature_digests_of_other_layers_not_comparable():
    """What the layout signature does not catch: same signature, fewer layers (a broadcast before)."""
    import dataclasses

    from dsv4_idxk_probe.digest.result import compare
    from tests.support.logdata import _buffers

    import numpy as np

    n_pages = -(-N_TOKENS // LAYOUT.page_tokens)
    buffers = _buffers(np.random.default_rng(1), n_pages)
    full = digest_room(buffers, list(range(n_pages)), N_TOKENS, LAYOUT, LAYER_IDS, key="1/0")
    for keep in (slice(0, 1), slice(0, -1)):
        fewer = dataclasses.replace(full, layer_ids=full.layer_ids[keep], layer_segment=full.layer_segment[keep])
        result = compare(full, fewer)
        assert (result.verdict, result.layers) == ("not_comparable", [])
        assert result.reason.startswith(f"layers differ: {len(LAYER_IDS)} layers")
    other = dataclasses.replace(full, segments=tuple(reversed(full.segments)))
    assert compare(full, other).reason.startswith("segments differ")


@pytest.mark.parametrize("layers", [LAYER_IDS[:1], LAYER_IDS[:-1], (*LAYER_IDS, 99)])
def test_digests_of_different_layer_counts_are_not_comparable_never_a_mismatch(tmp_path, layers):
    prefill, _ = one_room()
    write_lines(tmp_path / "p.jsonl", prefill)
    write_lines(tmp_path / "d.jsonl", [_decode_with_layers(layers)])
    out = tmp_path / "d.json"
    assert run(["diff", str(tmp_path / "p.jsonl"), str(tmp_path / "d.jsonl"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    stage = report["rooms"][0]["stages"][0]
    assert stage["verdict"] == "not_comparable" and "localisation" not in stage
    assert run(["diff", "--strict", str(tmp_path / "p.jsonl"), str(tmp_path / "d.jsonl")]) == 1


def test_a_lone_surrogate_room_id_from_the_probes_own_writer_joins_and_prints(tmp_path, capsys):
    prefill, decode = one_room()
    for r in prefill + decode:
        r["room"] = "room-\ud800"
    for role, records in (("prefill", prefill), ("decode", decode)):
        with RoomLogWriter(tmp_path / role, role) as writer:
            for r in records:
                assert writer.emit(r)
    out = tmp_path / "d.json"
    assert run(["diff", str(tmp_path / "prefill"), str(tmp_path / "decode"), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["summary"]["room_verdicts"] == {"match": 1}
    html = tmp_path / "r.html"
    assert run(["report", str(tmp_path / "prefill"), str(tmp_path / "decode"), "-o", str(html)]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_report_with_a_huge_timestamp_names_the_line_and_renders_the_rest(tmp_path, capsys):
    prefill, decode = one_room()
    bad = copy.deepcopy(decode[1])
    bad["ts"] = 1e300
    write_lines(tmp_path / "p.jsonl", prefill)
    write_lines(tmp_path / "d.jsonl", [decode[0], bad, *decode[2:]])
    assert run(["report", str(tmp_path), "-o", str(tmp_path / "r.html")]) == 0
    assert "d.jsonl:2: ts must be null or a Unix time" in capsys.readouterr().err


def test_one_gigabyte_line_in_a_small_gzip_is_skipped_with_bounded_memory(tmp_path):
    path = tmp_path / "bomb.jsonl.gz"
    chunk = b"a" * (1 << 20)
    with gzip.open(path, "wb", compresslevel=1) as f:
        for _ in range(1024):
            f.write(chunk)
        f.write(b"\n")
    assert path.stat().st_size < 8 << 20
    prefill, decode = one_room()
    write_lines(tmp_path / "good.jsonl", prefill + decode)
    code = (  # VmHWM: this process's peak (ru_maxrss would include the forking parent's)
        "import sys\n"
        "from dsv4_idxk_probe.cli.main import run\n"
        "status = run(sys.argv[1:])\n"
        "hwm = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
        "print(status, hwm)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code, "diff", str(path), str(tmp_path / "good.jsonl")],
                          capture_output=True, text=True, env=env, timeout=300)
    status, peak_kib = done.stdout.split()[-2:]
    assert int(status) == 2  # the skipped line is bad input
    assert "bomb.jsonl.gz:1: line is over 8,388,608 bytes (skipped unread)" in done.stderr
    assert int(peak_kib) < 400 * 1024, f"peak RSS {int(peak_kib) // 1024} MiB"


def test_bounded_reader_keeps_the_lines_after_a_long_one(tmp_path):
    from dsv4_idxk_probe.roomlog.reader import read_file

    prefill, _ = one_room()
    good = encode_line(prefill[0])
    path = tmp_path / "x.jsonl"
    path.write_bytes(good + b"x" * 5000 + b"\n" + good)
    entries = list(read_file(path, max_line=4096))
    assert [e.record is not None for e in entries] == [True, False, True]
    assert entries[1].error == "line is over 4,096 bytes (skipped unread)"


def test_file_over_the_file_bound_stops_with_a_named_entry(tmp_path):
    from dsv4_idxk_probe.roomlog.reader import read_file

    prefill, _ = one_room()
    good = encode_line(prefill[0])
    path = tmp_path / "x.jsonl"
    path.write_bytes(good * 10)
    entries = list(read_file(path, max_file=len(good) * 3))
    assert sum(e.record is not None for e in entries) == 3
    assert entries[-1].error.startswith("file is over")


# %% one exit rule for every command


def test_json_dash_means_stdout_and_the_table_goes_to_stderr(tmp_path, capsys):
    prefill, decode = one_room()
    write_lines(tmp_path / "p.jsonl", prefill)
    write_lines(tmp_path / "d.jsonl", decode)
    assert run(["diff", str(tmp_path), "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["summary"]["room_verdicts"] == {"match": 1}
    assert "rooms seen on decode" in captured.err
    assert not (Path.cwd() / "-").exists()


def test_broken_pipe_exits_quietly(tmp_path):
    prefill, decode = [], []
    for room in range(1, 400):
        p, d = room_records(RoomPlan(room))
        prefill += p
        decode += d
    write_lines(tmp_path / "p.jsonl", prefill)
    write_lines(tmp_path / "d.jsonl", decode)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "dsv4_idxk_probe", "diff", str(tmp_path), "--json", "-"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.read(100)
    proc.stdout.close()  # as `| head -c 100` does
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_internal_error_is_one_line_exit_3_and_a_traceback_only_with_debug(tmp_path, capsys, monkeypatch):
    prefill, decode = one_room()
    write_lines(tmp_path / "d.jsonl", prefill + decode)

    def broken(paths):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr("dsv4_idxk_probe.cli.diff.analyse", broken)
    assert run(["diff", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert err.strip() == ("dsv4-idxk-probe diff: internal error: ZeroDivisionError: a bug "
                           "(run with --debug for the traceback)")
    assert run(["--debug", "diff", str(tmp_path)]) == 3
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    assert run(["diff", "--debug", str(tmp_path)]) == 3
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_check_uses_the_common_prefix_for_a_bad_target_table(tmp_path, capsys):
    bad = tmp_path / "targets.yaml"
    bad.write_bytes(b"\xff\xfe not yaml")
    status = run(["check", "--targets", str(bad)])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("dsv4-idxk-probe check: ") and "Traceback" not in err


def test_version_and_the_exit_table_in_help(capsys):
    from dsv4_idxk_probe.version import __version__

    with pytest.raises(SystemExit) as info:
        run(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"dsv4-idxk-probe {__version__}"
    for argv in (["--help"], ["diff", "--help"], ["check", "--help"]):
        with pytest.raises(SystemExit):
            run(argv)
        out = capsys.readouterr().out
        assert "exit status (every command):" in out and "3    internal error" in out


# %% Reliability round two: hostile text, huge rids, odd kinds

# What a terminal or a page must never receive raw: C0 (but the newlines that end lines), DEL, C1,
# bidi controls, lone surrogates.
UNSAFE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")
HOSTILE = "rid\x1b[2J\x1b]52;c;ZXZpbA==\x07\x1b]0;owned\x07\nforged row\u202eevil\u2066\x9b31m"


def _hostile_logs(tmp_path):
    """A mismatching room whose rids, pool names and a diagnosis carry terminal escapes and
    bidi overrides; a file whose name does; a skipped line in it; an odd record kind."""
    from tests.support.logdata import hicache_record, roundtrip_record

    prefill, decode = room_records(RoomPlan(1, fault=Fault(0, 0, 0)))
    for rec in prefill + decode:
        rec["rid"] = HOSTILE
    hicache = hicache_record("pool\x1b[31m\u202e", "token\x1b]0;x\x07", "d2h\n")
    roundtrip = roundtrip_record()
    roundtrip["pool"] = "rt\x1b[2J\u202e"
    odd = {"v": 1, "kind": "kind\x1b[2J\u202e", "ts": 0.0}
    write_lines(tmp_path / "p.jsonl", prefill)
    name = tmp_path / "d\x1b[31m\u202e.jsonl"
    name.write_bytes(b"".join(encode_line(r) for r in [*decode, hicache, roundtrip, odd]) + b"not json\n")
    return tmp_path


def test_diff_prints_no_control_or_bidi_character_from_the_logs(tmp_path, capsys):
    logs = _hostile_logs(tmp_path)
    assert run(["diff", str(logs), "--max-errors", "5"]) == 1
    captured = capsys.readouterr()
    for stream in (captured.out, captured.err):
        assert not UNSAFE.search(stream), UNSAFE.search(stream)
    assert "rid\\x1b[2J\\x1b]52;c;ZXZpbA==\\x07" in captured.out  # the rid is there, escaped
    assert "\\u202e.jsonl:" in captured.err and "skipped " in captured.err  # the file name too
    assert "forged row" not in captured.out.split("\n")[0]


def test_diff_json_to_a_terminal_escapes_them_and_reads_back_the_same(tmp_path, capsys):
    logs = _hostile_logs(tmp_path)
    assert run(["diff", str(logs), "--json", "-"]) == 1
    captured = capsys.readouterr()
    assert not UNSAFE.search(captured.out) and not UNSAFE.search(captured.err)
    report = json.loads(captured.out)
    assert report["rooms"][0]["rid"] == {"prefill": HOSTILE, "decode": HOSTILE}  # the data is unchanged


def test_report_html_carries_no_control_or_bidi_character_from_the_logs(tmp_path, capsys):
    logs = _hostile_logs(tmp_path)
    out = tmp_path / "r.html"
    assert run(["report", str(logs), "-o", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    text = page.replace("\n", "")
    assert not UNSAFE.search(text), UNSAFE.search(text)
    assert "\\u202e" in page and "\\x1b[2J" in page
    captured = capsys.readouterr()
    assert not UNSAFE.search(captured.out) and not UNSAFE.search(captured.err)


def test_a_lone_surrogate_record_kind_does_not_crash_report_to_a_file(tmp_path, capsys):
    """The kind is counted under its escape: `report -o FILE` exited 3 (UnicodeEncodeError)."""
    prefill, decode = one_room()
    odd = {"v": 1, "kind": "k\ud800", "ts": 0.0}
    write_lines(tmp_path / "p.jsonl", prefill)
    write_lines(tmp_path / "d.jsonl", [*decode, odd])
    out = tmp_path / "r.html"
    assert run(["report", str(tmp_path), "-o", str(out)]) == 0
    assert "k\\ud800 1" in out.read_text(encoding="utf-8")
    assert run(["diff", str(tmp_path), "--json", str(tmp_path / "d.json")]) == 0
    assert json.loads((tmp_path / "d.json").read_text())["summary"]["records"]["k\\ud800"] == 1


def test_a_million_made_up_kinds_are_counted_in_a_bounded_table(tmp_path):
    from dsv4_idxk_probe.offline.join import MAX_KINDS, OTHER_KINDS

    prefill, decode = one_room()
    odd = [{"v": 1, "kind": f"kind-{i}-" + "x" * 500, "ts": 0.0} for i in range(300)]
    write_lines(tmp_path / "d.jsonl", [*prefill, *decode, *odd])
    assert run(["diff", str(tmp_path), "--json", str(tmp_path / "d.json")]) == 0
    kinds = json.loads((tmp_path / "d.json").read_text())["summary"]["records"]
    assert len(kinds) == MAX_KINDS + 1 and sum(kinds.values()) == 304 and kinds[OTHER_KINDS] > 200
    assert max(map(len, kinds)) < 200


@pytest.mark.parametrize("length", [100_000, 9 << 20])
def test_a_huge_rid_is_cut_with_a_marker_and_its_room_still_judged(tmp_path, capsys, caplog, length):
    """A 9 MiB rid put its line over the 8 MiB line bound: the room vanished and the diff
    exited 2. The rid is cut when read, the room kept and judged, and the cut logged."""
    prefill, decode = one_room()
    huge = "q" * length
    for rec in prefill + decode:
        rec["rid"] = huge
    write_lines(tmp_path / "p.jsonl", prefill)
    write_lines(tmp_path / "d.jsonl", decode)
    out = tmp_path / "d.json"
    assert run(["diff", str(tmp_path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["summary"]["room_verdicts"] == {"match": 1} and report["summary"]["bad_lines"] == 0
    rid = report["rooms"][0]["rid"]["decode"]
    assert rid.startswith("q" * 256) and len(rid) < 400 and "rid cut to 256 characters" in rid
    assert f"{length:,}" in rid  # how long it was
    assert len(capsys.readouterr().out) < 20_000
    said = [r.getMessage() for r in caplog.records if "rid cut to 256 characters" in r.getMessage()]
    assert sorted(m.split(":")[0].rsplit("/", 1)[-1] for m in said) == ["d.jsonl", "p.jsonl"]  # once a file


def test_a_long_line_is_still_skipped_when_its_excess_is_not_the_rid(tmp_path, capsys):
    prefill, decode = one_room()
    bad = copy.deepcopy(decode[0])
    bad["reason"] = "r" * (9 << 20)
    write_lines(tmp_path / "p.jsonl", prefill)
    write_lines(tmp_path / "d.jsonl", [bad, *decode[1:]])
    assert run(["diff", str(tmp_path)]) == 2
    assert "d.jsonl:1: line is over 8,388,608 bytes (skipped unread)" in capsys.readouterr().err


def test_a_squeezed_line_must_still_match_its_checksum(tmp_path, capsys):
    prefill, decode = one_room()
    rec = copy.deepcopy(decode[0])
    rec["rid"] = "q" * (9 << 20)
    line = bytearray(encode_line(rec))
    line[100] ^= 1  # edited after it was written
    write_lines(tmp_path / "p.jsonl", prefill)
    (tmp_path / "d.jsonl").write_bytes(bytes(line))
    assert run(["diff", str(tmp_path)]) == 2
    assert "d.jsonl:1: line is over 8,388,608 bytes" in capsys.readouterr().err


# %% values a hostile log may hold that Python's str and set methods trip over


def test_a_room_id_of_non_ascii_digits_joins_and_sorts_as_text(tmp_path, capsys):
    """"²".isdigit() is True but int("²") raises: such a room must sort as text, not crash the diff."""
    from dsv4_idxk_probe.offline.results import room_sort_key

    assert sorted(["10", "²", "9", "a", "٣"], key=room_sort_key) == ["9", "10", "a", "²", "٣"]
    prefill, decode = one_room()
    for r in prefill + decode:
        r["room"] = "²"
    write_lines(tmp_path / "d.jsonl", prefill + decode)
    out = tmp_path / "d.json"
    assert run(["diff", str(tmp_path), "--json", str(out)]) == 0, capsys.readouterr().err
    assert [r["room"] for r in json.loads(out.read_text())["rooms"]] == ["²"]
    assert run(["report", str(tmp_path), "-o", str(tmp_path / "r.html")]) == 0
    assert "internal error" not in capsys.readouterr().err


def test_a_journal_event_without_its_name_is_summarised_without_one(tmp_path, capsys):
    """Every field of a logged journal event is optional, `event` too: the diagnosis summary of
    a cell whose last event has no name says what the cell became, without an "after"."""
    prefill, decode = room_records(RoomPlan(1, fault=Fault(0, 0, 0)))
    for r in decode:
        r["localisation"] = {"verdict": "mismatch"}
        r["diagnosis"] = [{"kind": "zeroed", "segment": "payload", "layer": 0, "page": 0,
                           "events": [{"t_ns": 1, "page": 0}]}]
    write_lines(tmp_path / "d.jsonl", prefill + decode)
    out = tmp_path / "d.json"
    assert run(["diff", str(tmp_path), "--json", str(out)]) == 1
    text = capsys.readouterr()
    assert "diagnosis: 1 cell zeroed" in text.out and "internal error" not in text.err
    assert run(["report", str(tmp_path), "-o", str(tmp_path / "r.html")]) == 0
    assert "internal error" not in capsys.readouterr().err


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(leg=["h2d"]), "roundtrip_diagnosis.leg must be null or one of"),
    (lambda r: r.update(checks={"h2d": ["x"]}), "roundtrip_diagnosis.checks must map"),
    (lambda r: r["events"][1]["host_row_checks"].update(host={"a": 1}), "events[1].host_row_checks must map"),
])
def test_a_round_trip_diagnosis_with_a_list_or_object_value_is_a_named_bad_line(tmp_path, capsys, edit, message):
    """Unhashable values where a set of names is expected: the field named, never `unhashable type`."""
    from tests.support.logdata import roundtrip_record

    rec = roundtrip_record()
    edit(rec)
    prefill, decode = one_room()
    write_lines(tmp_path / "d.jsonl", prefill + decode + [rec])
    assert run(["diff", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "d.jsonl:5:" in err and "internal error" not in err


@pytest.mark.parametrize("kind", [["zeroed"], {"zeroed": 1}])
def test_a_diagnosis_kind_that_is_a_list_or_object_is_a_named_bad_line(tmp_path, capsys, kind):
    prefill, decode = one_room()
    bad = copy.deepcopy(decode[0])
    bad["diagnosis"] = [{"kind": kind, "segment": "payload"}]
    write_lines(tmp_path / "d.jsonl", prefill + decode + [bad])
    assert run(["diff", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "d.jsonl:5: diagnosis[0].kind must be one of" in err and "internal error" not in err
