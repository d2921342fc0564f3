"""The room-log writer: never blocks its caller, counts drops, rotates, gzips."""

from __future__ import annotations

import gzip
import threading

import pytest
from prometheus_client import CollectorRegistry

from dsv4_idxk_probe.metrics.definitions import ProbeMetrics
from dsv4_idxk_probe.roomlog import RoomLogWriter, read_entries


def record(i: int, pad: int = 0) -> dict:
    return {"v": 1, "kind": "room", "room": str(i), "attempt": 0, "stage": "decode_recv", "pad": "x" * pad}


def read_back(files):
    entries = list(read_entries(files))
    assert all(e.error is None for e in entries), [e.error for e in entries if e.error]
    return [int(e.record["room"]) for e in entries]


def test_everything_emitted_is_written_in_order_after_close(tmp_path):
    writer = RoomLogWriter(tmp_path, "decode")
    assert all(writer.emit(record(i)) for i in range(500))
    writer.close()
    assert not writer.thread.is_alive() and writer.thread.daemon
    assert read_back(writer.files) == list(range(500))
    assert writer.dropped == 0 and writer.written == 500


def test_full_queue_drops_and_counts_without_waiting(tmp_path):
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, role="decode")
    writer = RoomLogWriter(tmp_path, "decode", queue_size=3, metrics=metrics, start=False)
    results = []
    caller = threading.Thread(target=lambda: results.extend(writer.emit(record(i)) for i in range(10)))
    caller.start()
    caller.join(timeout=5)
    assert not caller.is_alive(), "emit() waited on a full queue"
    assert results == [True] * 3 + [False] * 7
    assert writer.dropped == 7
    labels = {**metrics.process_labels, "sink": "roomlog"}
    assert registry.get_sample_value("dsv4_idxk_probe_records_dropped_total", labels) == 7
    writer.start()
    writer.close()
    assert read_back(writer.files) == [0, 1, 2]


def test_emit_after_close_is_a_counted_drop(tmp_path):
    writer = RoomLogWriter(tmp_path, "prefill")
    writer.close()
    assert writer.emit(record(1)) is False and writer.dropped == 1


def test_rotation_by_size_keeps_the_newest_files_gzipped(tmp_path):
    writer = RoomLogWriter(tmp_path, "prefill", max_bytes=4096, max_files=3, gzip_rotated=True)
    for i in range(200):
        writer.emit(record(i, pad=100))
    writer.close()
    files = sorted(tmp_path.iterdir())
    assert len(files) == 3
    assert [f.name.endswith(".jsonl.gz") for f in files] == [True, True, False]
    for f in files[:-1]:
        with gzip.open(f, "rb") as g:
            assert len(g.read()) <= 4096
    assert files[-1].stat().st_size <= 4096
    rooms = read_back(files)
    assert rooms == list(range(200 - len(rooms), 200)), "the newest records survive, in order"


@pytest.mark.parametrize("max_files", [1, 3])
def test_rotation_never_has_more_than_max_files_on_disk(tmp_path, monkeypatch, max_files):
    """Counted after every call that adds a name (a file opened, a .gz renamed into place): the
    gzip of a rotated file and the deletion of the oldest must not leave max_files + 1 files."""
    from dsv4_idxk_probe.roomlog import writer as writer_module

    seen = []

    def visible() -> int:
        return sum(1 for p in tmp_path.iterdir() if not p.name.startswith("."))

    real_replace, real_open = writer_module.os.replace, writer_module.os.open

    def replace(*args, **kwargs):
        real_replace(*args, **kwargs)
        seen.append(visible())

    def open_(*args, **kwargs):
        fd = real_open(*args, **kwargs)
        seen.append(visible())
        return fd

    monkeypatch.setattr(writer_module.os, "replace", replace)
    monkeypatch.setattr(writer_module.os, "open", open_)
    writer = RoomLogWriter(tmp_path, "decode", max_bytes=2048, max_files=max_files, gzip_rotated=True)
    for i in range(300):
        writer.emit(record(i, pad=100))
    writer.close()
    assert len(seen) > 10, "the writer rotated several times"
    assert max(seen) <= max_files, seen
    assert visible() == max_files
    rooms = read_back(writer.files)
    assert rooms == list(range(300 - len(rooms), 300)), "the newest records survive, in order"


def test_rotation_without_gzip(tmp_path):
    writer = RoomLogWriter(tmp_path, "prefill", max_bytes=2048, max_files=50, gzip_rotated=False)
    for i in range(100):
        writer.emit(record(i, pad=50))
    writer.close()
    assert all(f.suffix == ".jsonl" for f in tmp_path.iterdir()) and len(list(tmp_path.iterdir())) > 2
    assert read_back(sorted(tmp_path.iterdir())) == list(range(100))


def test_a_record_that_is_not_json_is_dropped_and_the_writer_goes_on(tmp_path):
    writer = RoomLogWriter(tmp_path, "decode")
    writer.emit(record(1))
    writer.emit({"v": 1, "bad": object()})
    writer.emit(record(2))
    writer.close()
    assert read_back(writer.files) == [1, 2] and writer.dropped == 1


def test_a_torn_last_line_is_reported_and_the_rest_read(tmp_path):
    writer = RoomLogWriter(tmp_path, "decode")
    for i in range(3):
        writer.emit(record(i))
    writer.close()
    path = writer.files[-1]
    data = path.read_bytes()
    path.write_bytes(data[:-20])  # a crash mid-write of the last line
    entries = list(read_entries([path]))
    assert [e.record["room"] for e in entries if e.record] == ["0", "1"]
    assert [(e.line, e.error is not None) for e in entries if e.record is None] == [(3, True)]


def test_a_new_writer_never_appends_to_an_old_file(tmp_path):
    first = RoomLogWriter(tmp_path, "decode")
    first.emit(record(1))
    first.close()
    second = RoomLogWriter(tmp_path, "decode")  # same host and pid: pid reuse after a restart
    second.emit(record(2))
    second.close()
    assert first.files[0] != second.files[0]
    assert read_back(first.files) == [1] and read_back(second.files) == [2]


def test_flush_waits_for_the_queue(tmp_path):
    writer = RoomLogWriter(tmp_path, "decode")
    for i in range(50):
        writer.emit(record(i))
    assert writer.flush(timeout=5)
    assert read_back(writer.files) == list(range(50))
    writer.close()


@pytest.mark.parametrize("kwargs", [{"max_bytes": 0}, {"max_files": 0}, {"queue_size": 0}, {"role": "de/code"}])
def test_bad_settings_are_refused(tmp_path, kwargs):
    args = {"role": "decode", **kwargs}
    with pytest.raises(ValueError):
        RoomLogWriter(tmp_path, **args)
