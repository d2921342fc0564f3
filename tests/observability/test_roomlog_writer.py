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

    real_replace, real_open, real_link = writer_module.os.replace, writer_module.os.open, writer_module.os.link

    def replace(*args, **kwargs):
        real_replace(*args, **kwargs)
        seen.append(visible())

    def link(*args, **kwargs):  # the .gz comes into place by a link (never over another file)
        real_link(*args, **kwargs)
        seen.append(visible())

    def open_(*args, **kwargs):
        fd = real_open(*args, **kwargs)
        seen.append(visible())
        return fd

    monkeypatch.setattr(writer_module.os, "replace", replace)
    monkeypatch.setattr(writer_module.os, "open", open_)
    monkeypatch.setattr(writer_module.os, "link", link)
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


def test_a_record_nested_past_the_encoders_depth_costs_that_record_only(tmp_path):
    """The fallback encoder's RecursionError took the whole batch with it, uncounted."""
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    writer = RoomLogWriter(tmp_path, "decode", start=False)
    for i in range(5):
        writer.emit(record(i))
    writer.emit({"v": 1, "kind": "room", "x": deep})
    for i in range(5, 10):
        writer.emit(record(i))
    writer.start()
    writer.close()
    assert (read_back(writer.files), writer.written, writer.dropped) == (list(range(10)), 10, 1)


def test_a_torn_last_line_is_counted_as_torn_and_the_rest_read(tmp_path):
    writer = RoomLogWriter(tmp_path, "decode")
    for i in range(3):
        writer.emit(record(i))
    writer.close()
    path = writer.files[-1]
    data = path.read_bytes()
    path.write_bytes(data[:-20])  # a crash mid-write of the last line
    entries = list(read_entries([path]))
    assert [e.where for e in entries if e.error] == []  # a crash is not bad input
    assert [e.record["room"] for e in entries] == ["0", "1"]
    torn = []
    list(read_entries([path], torn=torn))
    assert [(e.line, e.record) for e in torn] == [(3, None)] and "torn" in torn[0].error


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


# %% a directory it shares (issue "Reliability round two")


import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

from dsv4_idxk_probe.roomlog import expand_inputs

REPO = Path(__file__).resolve().parents[2]
SECRET = b"root:only:secret\n"


def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


def holds_secret(directory) -> list[str]:
    out = []
    for p in directory.iterdir():
        if p.is_symlink():  # the planted links themselves
            continue
        data = p.read_bytes()
        if p.name.endswith(".gz"):
            data = gzip.decompress(data)
        if SECRET in data:
            out.append(p.name)
    return out


def test_a_link_planted_at_the_next_file_name_is_never_followed(tmp_path):
    """Names are predictable (role-host-pid.seq): a link at the next ones must neither be
    appended to nor compressed into the directory; the writer skips the name."""
    logs = tmp_path / "logs"
    secret = secret_file(tmp_path)
    writer = RoomLogWriter(logs, "decode", max_bytes=2048, max_files=1000, gzip_rotated=True, start=False)
    planted = [writer._path(writer._seq + k) for k in range(4)]  # the first file and the next three
    for link in planted:
        link.symlink_to(secret)
    writer.start()
    for i in range(60):
        writer.emit(record(i, pad=100))
    writer.close()
    assert secret.read_bytes() == SECRET, "the writer appended to the file a planted link points at"
    assert holds_secret(logs) == [], "a planted link's target was copied into the log directory"
    assert all(p.is_symlink() for p in planted), "a planted link was deleted or replaced"
    assert read_back(writer.files) == list(range(60)) and writer.dropped == 0
    assert not set(planted) & set(writer.files)


def test_a_file_swapped_in_after_close_is_not_compressed_nor_deleted(tmp_path):
    """Between closing a full file and compressing it, its name comes to hold someone else's
    file (here a link to a root-only one): the writer checks by fd (inode, owner) and leaves it."""
    logs = tmp_path / "logs"
    secret = secret_file(tmp_path)
    writer = RoomLogWriter(logs, "decode", max_bytes=2048, max_files=1000, gzip_rotated=True, start=False)
    real_close = writer._close_file
    swapped = []

    def close_then_swap():
        path = writer._files[-1] if writer._fd is not None and writer._files else None
        real_close()
        if path is not None and not swapped:
            path.unlink()
            path.symlink_to(secret)
            swapped.append(path)

    writer._close_file = close_then_swap
    writer.start()
    for i in range(40):
        writer.emit(record(i, pad=100))
    writer.close()
    assert swapped, "the writer rotated"
    assert secret.read_bytes() == SECRET
    assert holds_secret(logs) == []
    assert swapped[0].is_symlink(), "the swapped-in name was deleted"
    assert not (logs / (swapped[0].name + ".gz")).exists()


def test_modes_are_set_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        logs = tmp_path / "a" / "logs"  # parents too
        writer = RoomLogWriter(logs, "decode", max_bytes=2048, max_files=10, gzip_rotated=True)
        for i in range(40):
            writer.emit(record(i, pad=100))
        writer.close()
        os.umask(0o077)
        narrow = RoomLogWriter(tmp_path / "b", "decode", gzip_rotated=False)
        narrow.emit(record(1))
        narrow.close()
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)
    assert mode(logs) == mode(logs.parent) == 0o750
    files = list(logs.iterdir())
    assert any(f.name.endswith(".gz") for f in files) and any(f.name.endswith(".jsonl") for f in files)
    assert {f.name: mode(f) for f in files} == {f.name: 0o640 for f in files}
    assert mode(tmp_path / "b") == 0o750 and [mode(f) for f in narrow.files] == [0o640]


def refused(writer, n=3):
    for i in range(n):
        assert writer.emit(record(i)) is True  # never raises, never blocks
    writer.close()
    assert (writer.written, writer.dropped) == (0, n) and writer.write_errors >= 1


def test_a_world_writable_directory_without_the_sticky_bit_is_refused(tmp_path, caplog):
    logs = tmp_path / "logs"
    logs.mkdir()
    logs.chmod(0o777)
    with caplog.at_level(logging.ERROR, "dsv4_idxk_probe.roomlog"):
        writer = RoomLogWriter(logs, "decode")
        refused(writer)
    assert list(logs.iterdir()) == []
    assert "writable by every user without the sticky bit" in caplog.text


def test_a_sticky_world_writable_directory_is_accepted(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    logs.chmod(0o1777)  # as /tmp
    writer = RoomLogWriter(logs, "decode")
    writer.emit(record(1))
    writer.close()
    assert read_back(writer.files) == [1]


def test_a_directory_of_another_user_is_refused(tmp_path, monkeypatch, caplog):
    from dsv4_idxk_probe.roomlog import writer as writer_module

    logs = tmp_path / "logs"
    logs.mkdir(mode=0o755)
    if os.geteuid() == 0:
        os.chown(logs, 4242, 4242)
    else:  # we cannot give it away: become, to the writer, another user than its owner
        monkeypatch.setattr(writer_module.os, "geteuid", lambda: os.getuid() + 1)
    with caplog.at_level(logging.ERROR, "dsv4_idxk_probe.roomlog"):
        refused(RoomLogWriter(logs, "decode"))
    assert list(logs.iterdir()) == [] and "neither this process's user" in caplog.text


def test_a_group_writable_directory_is_used_with_a_warning(tmp_path, caplog):
    logs = tmp_path / "logs"
    logs.mkdir()
    logs.chmod(0o770)
    with caplog.at_level(logging.WARNING, "dsv4_idxk_probe.roomlog"):
        writer = RoomLogWriter(logs, "decode")
        writer.emit(record(1))
        writer.close()
    assert read_back(writer.files) == [1]
    assert "group-writable" in caplog.text


SAME_STEM_CHILD = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import dsv4_idxk_probe.roomlog.writer as w

    logs, tag, n, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    w._file_stem = lambda role: role + "-samehost-7"  # two containers: same host name, same pid
    writer = w.RoomLogWriter(logs, "decode", max_bytes=4096, max_files=100000, queue_size=100000)
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:  # both start writing at once
        time.sleep(0.001)
    for i in range(n):
        writer.emit({"v": 1, "kind": "room", "room": f"{tag}-{i}", "attempt": 0, "stage": "decode_recv",
                     "pad": "x" * 60})
        if i % 16 == 15:
            writer.flush()
    writer.close()
    print(json.dumps({"written": writer.written, "dropped": writer.dropped}))
""")


def test_two_processes_with_the_same_file_stem_lose_no_record(tmp_path):
    """Two writer processes (two ranks, two containers with the same host name and pid) in one
    directory: each file belongs to one writer (O_EXCL), so all 2N records are read back."""
    n = 1500
    logs, go = tmp_path / "logs", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    children = [subprocess.Popen([sys.executable, "-c", SAME_STEM_CHILD, str(logs), tag, str(n), str(go)],
                                 env=env, stdout=subprocess.PIPE, text=True) for tag in ("a", "b")]
    assert [c.stdout.readline().strip() for c in children] == ["ready", "ready"]
    go.touch()
    outs = [json.loads(c.communicate(timeout=120)[0].strip().splitlines()[-1]) for c in children]
    assert all(c.returncode == 0 for c in children)
    entries = list(read_entries(expand_inputs([str(logs)])))
    assert [e.error for e in entries if e.error] == []
    rooms = [e.record["room"] for e in entries]
    assert sorted(rooms) == sorted(f"{tag}-{i}" for tag in ("a", "b") for i in range(n)), (
        f"{2 * n - len(set(rooms))} of {2 * n} records lost, {len(rooms) - len(set(rooms))} duplicated; {outs}")
    assert outs == [{"written": n, "dropped": 0}] * 2


def test_a_folder_that_cannot_be_listed_is_named_not_raised(tmp_path, monkeypatch):
    """`diff /proc/1` ended in an internal error (exit 3): its cwd cannot be listed (found by review)."""
    from pathlib import Path

    from dsv4_idxk_probe.roomlog.reader import InputError, expand_inputs

    (tmp_path / "logs").mkdir()

    def refused(self, pattern):
        raise PermissionError(13, "Permission denied", str(self / "secret"))

    monkeypatch.setattr(Path, "rglob", refused)
    with pytest.raises(InputError, match="logs: cannot list .*secret: Permission denied"):
        expand_inputs([str(tmp_path / "logs")])
