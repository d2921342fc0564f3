"""Reading logs back: inputs by file, directory or glob; gzip; bad bytes become errors."""

from __future__ import annotations

import gzip
import os

import pytest

from dsv4_idxk_probe.roomlog import InputError, encode_line, expand_inputs, read_entries


def write(path, rooms, compress=False):
    data = b"".join(encode_line({"v": 1, "kind": "room", "room": str(r)}) for r in rooms)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def rooms_of(paths):
    return [e.record["room"] for e in read_entries(paths) if e.record]


def test_directories_globs_and_files_expand_once_each(tmp_path):
    a = write(tmp_path / "p" / "prefill-h-1.000001.jsonl.gz", [1, 2], compress=True)
    b = write(tmp_path / "p" / "prefill-h-1.000002.jsonl", [3])
    c = write(tmp_path / "d" / "sub" / "decode-h-2.000001.jsonl", [4])
    (tmp_path / "p" / "notes.txt").write_text("not a log")
    got = expand_inputs([str(tmp_path / "p"), str(tmp_path / "d"), str(tmp_path / "p" / "*.jsonl*"), str(b)])
    assert got == [a, b, c]
    assert rooms_of(got) == ["1", "2", "3", "4"]


def test_gzip_is_recognised_by_content_not_name(tmp_path):
    path = write(tmp_path / "renamed.jsonl", [7, 8], compress=True)
    assert rooms_of([path]) == ["7", "8"]


@pytest.mark.parametrize(
    "arg, message",
    [("missing.jsonl", "no such file"), ("nothing-*.jsonl", "glob matches no file"), ("emptydir", "holds no")],
)
def test_inputs_that_name_nothing_are_input_errors(tmp_path, arg, message):
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(InputError, match=message) as info:
        expand_inputs([str(tmp_path / arg)])
    assert str(tmp_path / arg) in str(info.value)


def test_truncated_gzip_yields_its_good_lines_then_one_error(tmp_path):
    path = write(tmp_path / "cut.jsonl.gz", range(2000), compress=True)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    entries = list(read_entries([path]))
    good = [e for e in entries if e.record]
    bad = [e for e in entries if e.error]
    assert good and [e.record["room"] for e in good] == [str(i) for i in range(len(good))]
    assert bad and bad[-1].line >= len(good) and str(path) in bad[-1].where


def test_binary_garbage_becomes_error_entries_with_line_numbers(tmp_path):
    path = tmp_path / "garbage.jsonl"
    path.write_bytes(os.urandom(3000) + b"\n" + encode_line({"v": 1, "room": "ok"}) + b"\xff\xfe\n")
    entries = list(read_entries([path]))
    assert any(e.record == {"v": 1, "room": "ok"} for e in entries)
    errors = [e for e in entries if e.error]
    assert errors and all(e.where.startswith(f"{path}:") for e in errors)


# %% a torn final line (a crash mid-write) is not bad input


def torn_copy(path, cut=20):
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    return path


@pytest.mark.parametrize("compress", [False, True])
def test_a_torn_final_line_is_skipped_and_counted_not_an_error(tmp_path, compress):
    data = b"".join(encode_line({"v": 1, "kind": "room", "room": str(r)}) for r in range(3))[:-20]
    path = tmp_path / "cut.jsonl"
    path.write_bytes(gzip.compress(data) if compress else data)
    entries = list(read_entries([path]))
    assert [e.where for e in entries if e.error] == []  # a crash is not bad input
    assert [e.record["room"] for e in entries] == ["0", "1"]
    torn = []
    assert list(read_entries([path], torn=torn)) == entries  # counted where the caller asks
    assert [(e.where, e.record) for e in torn] == [(f"{path}:3", None)]


@pytest.mark.parametrize(
    "tail",
    [
        b'{"v":1,"kind":"ro\n' + encode_line({"v": 1, "room": "9"}),  # torn bytes with a line after them
        b"garbage with no newline",  # not the start of a line
        encode_line({"v": 1, "room": "9"})[:-1].replace(b'"9"', b'"8"'),  # whole, but edited
    ],
)
def test_only_a_torn_final_line_is_forgiven(tmp_path, tail):
    path = tmp_path / "log.jsonl"
    path.write_bytes(encode_line({"v": 1, "room": "1"}) + tail)
    entries = list(read_entries([path]))
    assert [e.line for e in entries if e.error] == [2]
    torn = []
    list(read_entries([path], torn=torn))
    assert torn == []


def test_a_whole_final_line_without_its_newline_is_read(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(encode_line({"v": 1, "room": "1"}) + encode_line({"v": 1, "room": "2"})[:-1])
    assert rooms_of([path]) == ["1", "2"]
    torn = []
    list(read_entries([path], torn=torn))
    assert torn == []


def test_diff_of_logs_with_a_torn_final_line_is_not_bad_input(logs, tmp_path):
    """Issue "Reliability round two": a server killed mid-write left a torn last line, and
    `diff` said bad input (exit 2) for that log set for good."""
    try:
        from tests.support.logdata import RoomPlan
    except ImportError:
        from logdata import RoomPlan
    from dsv4_idxk_probe.cli.main import run

    prefill, decode = logs([RoomPlan(i) for i in range(1, 4)])
    torn_copy(sorted(decode.glob("*.jsonl"))[-1])
    assert run(["diff", str(prefill), str(decode), "--json", str(tmp_path / "d.json")]) == 0
    import json

    report = json.loads((tmp_path / "d.json").read_text())
    assert report["summary"]["bad_lines"] == 0
