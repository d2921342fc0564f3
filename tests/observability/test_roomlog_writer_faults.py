"""The room-log writer when its disk fills or its directory disappears."""

from __future__ import annotations

import errno
import os
import shutil

from dsv4_idxk_probe.roomlog.reader import expand_inputs, read_entries
from dsv4_idxk_probe.roomlog.writer import RoomLogWriter
import dsv4_idxk_probe.roomlog.writer as writer_module


def record(i: int) -> dict:
    return {"v": 1, "kind": "room", "room": str(i), "attempt": 0, "stage": "decode_recv", "pad": "x" * 200}


def entries(path):
    return list(read_entries(expand_inputs([str(path)])))


def test_a_write_that_fills_the_disk_leaves_no_torn_fragment(tmp_path, monkeypatch):
    writer = RoomLogWriter(tmp_path, "decode", gzip_rotated=False)
    assert writer.emit(record(0)) and writer.flush()
    real_write = os.write
    calls = {"n": 0}

    def full_disk(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:  # half of the batch reaches the disk, then ENOSPC
            real_write(fd, bytes(data[: len(data) // 2 + 7]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(writer_module.os, "write", full_disk)
    assert writer.emit(record(1)) and writer.flush()  # dropped: the disk was full
    monkeypatch.setattr(writer_module.os, "write", real_write)
    assert writer.emit(record(2)) and writer.flush()  # the disk has room again
    writer.close()
    got = entries(tmp_path)
    assert [e.error for e in got] == [None, None]
    assert [e.record["room"] for e in got] == ["0", "2"]
    assert (writer.written, writer.dropped, writer.write_errors) == (2, 1, 1)


def test_a_deleted_directory_is_recreated_and_the_loss_counted(tmp_path):
    directory = tmp_path / "logs"
    writer = RoomLogWriter(directory, "decode", gzip_rotated=False)
    assert writer.emit(record(0)) and writer.flush()
    shutil.rmtree(directory)  # record 0 goes with it
    assert writer.emit(record(1)) and writer.flush()  # the check before this batch finds the loss
    assert writer.emit(record(2)) and writer.flush()
    writer.close()
    assert directory.is_dir() and writer.dir_recreated == 1
    rooms = [e.record["room"] for e in entries(directory)]
    assert rooms == ["1", "2"]
    assert (writer.lost, writer.dropped, writer.written) == (1, 1, 2)  # 0: counted written, then lost


def test_a_deleted_directory_is_recreated_at_rotation_too(tmp_path):
    directory = tmp_path / "logs"
    writer = RoomLogWriter(directory, "decode", max_bytes=1024, max_files=3, gzip_rotated=True)
    for i in range(3):
        assert writer.emit(record(i))
    assert writer.flush()
    shutil.rmtree(directory)
    for i in range(3, 30):
        assert writer.emit(record(i)) and writer.flush()
    writer.close()
    rooms = {e.record["room"] for e in entries(directory) if e.record is not None}
    assert {"29", "28"} <= rooms  # records after the delete keep landing, in new files
    assert writer.dir_recreated >= 1 and writer.written + writer.dropped == 30


def test_a_replaced_file_is_detected_and_not_written_into(tmp_path):
    writer = RoomLogWriter(tmp_path, "decode", gzip_rotated=False)
    assert writer.emit(record(0)) and writer.flush()
    first = writer.files[0]
    first.rename(tmp_path / "moved-away.jsonl")
    first.write_text("an operator's own file\n")
    assert writer.emit(record(1)) and writer.flush()
    writer.close()
    assert first.read_text() == "an operator's own file\n"
    assert writer.lost == 1


def test_nan_or_infinity_drops_the_record_as_documented(tmp_path):
    writer = RoomLogWriter(tmp_path, "decode")
    assert writer.emit({**record(0), "ts": float("nan")})
    assert writer.emit({**record(1), "ts": float("inf")})
    assert writer.emit({**record(2), "ts": 1.5})
    writer.close()
    assert [e.record["room"] for e in entries(tmp_path)] == ["2"]
    assert writer.dropped == 2


def test_a_dir_that_names_a_file_fails_closed_and_counted(tmp_path):
    """roomlog.dir naming a file: Runtime.emit (the serving thread) must not raise; every record
    is dropped and counted, and the failure is counted in errors_total."""
    from prometheus_client import CollectorRegistry

    from dsv4_idxk_probe.config import parse_config
    from dsv4_idxk_probe.runtime import Runtime

    (tmp_path / "not-a-dir").write_text("an operator's file\n")
    config = parse_config({"roomlog": {"dir": "not-a-dir"}}, "probe.yaml", tmp_path)
    registry = CollectorRegistry()
    labels = {"model_name": "m", "engine_type": "decode", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
    runtime = Runtime(config, registry=registry, identity=lambda: labels)
    for i in range(3):
        runtime.emit(record(i))  # raised FileExistsError before
    assert runtime._writer is not None and runtime._writer.flush()
    writer = runtime._writer
    runtime.close()
    assert (tmp_path / "not-a-dir").read_text() == "an operator's file\n"
    assert (writer.written, writer.dropped) == (0, 3) and writer.write_errors >= 1
    assert registry.get_sample_value("dsv4_idxk_probe_records_dropped_total", {**labels, "sink": "roomlog"}) == 3
    assert registry.get_sample_value("dsv4_idxk_probe_errors_total", {**labels, "component": "other"}) >= 1


def test_a_directory_that_becomes_usable_is_written_again(tmp_path):
    """Failing closed is not for good: once the path is a usable directory, records land again."""
    path = tmp_path / "logs"
    path.write_text("in the way\n")
    writer = RoomLogWriter(path, "decode", gzip_rotated=False)
    assert writer.emit(record(0)) and writer.flush()
    path.unlink()
    assert writer.emit(record(1)) and writer.flush()
    writer.close()
    assert [e.record["room"] for e in entries(path)] == ["1"]
    assert (writer.written, writer.dropped) == (1, 1)
