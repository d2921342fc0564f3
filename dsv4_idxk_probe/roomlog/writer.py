"""Background room-log writer: a bounded queue drained by one daemon thread.

The serving thread only calls `emit`, which never waits: when the queue is
full the record is dropped and counted (and
``dsv4_idxk_probe_records_dropped_total{sink="roomlog"}`` incremented when
metrics are attached). The thread serialises, checksums and appends whole
lines with one ``os.write`` per batch, so a crash can tear at most the last
line, which the reader then rejects. Files rotate by size; the newest
`max_files` are kept; rotated files are optionally gzipped (temp file, then
rename, so a reader never sees half a .gz).
"""

from __future__ import annotations

import gzip
import logging
import os
import queue
import re
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

from .lineformat import encode_line

log = logging.getLogger("dsv4_idxk_probe.roomlog")

_STOP = object()
_BATCH_LINES = 256


def _file_stem(role: str) -> str:
    """role-host-pid: one writer per process, so names never collide across pods."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"
    return f"{role}-{host}-{os.getpid()}"


class RoomLogWriter:
    """Append room records to ``<dir>/<role>-<host>-<pid>.<seq>.jsonl``.

    Call `close()` (or use it as a context manager) to drain the queue and stop
    the thread; `thread` is exposed so the owner can join it.
    """

    def __init__(
        self,
        path_dir: str | os.PathLike,
        role: str,
        *,
        max_bytes: int = 64 << 20,
        max_files: int = 8,
        gzip_rotated: bool = True,
        queue_size: int = 10_000,
        metrics: Any = None,
        start: bool = True,
    ):
        if max_bytes <= 0 or max_files < 1 or queue_size < 1:
            raise ValueError("max_bytes, max_files and queue_size must be positive")
        if not re.fullmatch(r"[A-Za-z0-9_-]+", role):
            raise ValueError(f"role {role!r} must be letters, digits, '_' or '-'")
        self.dir = Path(path_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stem = _file_stem(role)
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.gzip_rotated = gzip_rotated
        self.metrics = metrics
        self.dropped = 0  # queue full, closed, or unserialisable
        self.write_errors = 0
        self.written = 0
        self.lost = 0  # counted as written, then found in a deleted or replaced file
        self.dir_recreated = 0
        self._unchecked = 0  # lines written since the file was last found in place
        self._dir_ino = 0
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._closed = False
        self._count_lock = threading.Lock()
        self._seq = self._next_free_seq()
        self._fd: int | None = None
        self._size = 0
        self._files: list[Path] = []  # files of this writer, oldest first (current last)
        self.thread = threading.Thread(target=self._run, name="dsv4-idxk-probe-roomlog", daemon=True)
        if start:
            self.start()

    # %% caller side (never blocks)

    def start(self) -> threading.Thread:
        """Start the writer thread (once); returns it for the owner to join."""
        if not self.thread.is_alive() and self.thread.ident is None:
            self.thread.start()
        return self.thread

    def emit(self, record: dict) -> bool:
        """Queue `record` for writing; False (and counted) if it was dropped. Never waits.

        The writer owns `record` from here on; do not mutate it afterwards.
        """
        if self._closed:
            self._drop()
            return False
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._drop()
            return False
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued record has been handled; False on timeout (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting records, drain what is queued, stop the thread, close the file."""
        if self._closed:
            return
        self._closed = True
        if self.thread.is_alive():
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    self._queue.put(_STOP, timeout=0.05)
                    break
                except queue.Full:
                    continue
            self.thread.join(max(0.0, deadline - time.monotonic()))
        else:
            self._drain_unstarted()
        if not self.thread.is_alive():
            self._close_file()

    def __enter__(self) -> "RoomLogWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def files(self) -> list[Path]:
        """This writer's files that still exist, oldest first."""
        return [p for p in self._files if p.exists()]

    def _drop(self, n: int = 1) -> None:
        with self._count_lock:
            self.dropped += n
        if self.metrics is not None:
            try:
                self.metrics.records_dropped.labels(sink="roomlog").inc(n)
            except Exception:  # metrics must never break the caller
                log.debug("records_dropped metric failed", exc_info=True)

    def _drain_unstarted(self) -> None:
        """close() before start(): what is queued was never written; count it as dropped."""
        n = 0
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            self._queue.task_done()
            n += 1
        if n:
            self._drop(n)

    # %% writer thread

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while len(batch) < _BATCH_LINES:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(x is _STOP for x in batch)
            try:
                self._write_batch([x for x in batch if x is not _STOP])
            except Exception:  # never let the thread die silently with records queued
                log.exception("room log writer failed")
            finally:
                for _ in batch:
                    self._queue.task_done()
            if stop:
                self._drain_after_stop()
                return

    def _drain_after_stop(self) -> None:
        rest = []
        while True:
            try:
                rest.append(self._queue.get_nowait())
            except queue.Empty:
                break
        try:
            self._write_batch([x for x in rest if x is not _STOP])
        finally:
            for _ in rest:
                self._queue.task_done()

    def _write_batch(self, records: list) -> None:
        pending: list[bytes] = []
        pending_size = 0
        for record in records:
            try:
                line = encode_line(record)
            except (TypeError, ValueError):
                log.warning("room log: dropped a record that is not plain JSON", exc_info=True)
                self._drop()
                continue
            in_file = self._size + pending_size
            if in_file > 0 and in_file + len(line) > self.max_bytes:
                self._write(pending)
                pending, pending_size = [], 0
                self._rotate()
            pending.append(line)
            pending_size += len(line)
        self._write(pending)

    def _write(self, lines: list[bytes]) -> None:
        """Append whole lines: after a failed write the file is cut back to its last good
        offset, so no torn fragment can join the next record."""
        if not lines:
            return
        data = b"".join(lines)
        try:
            if self._fd is not None:
                if self._still_ours():
                    self._unchecked = 0  # what went before is in place
                else:
                    self._replaced()
            if self._fd is None:
                self._open()
        except OSError:
            self._write_failed(len(lines))
            return
        start = self._size
        try:
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError:
            self._cut_back(start)
            self._write_failed(len(lines))
            return
        self._size += len(data)
        self.written += len(lines)
        self._unchecked += len(lines)

    def _write_failed(self, n: int) -> None:
        self.write_errors += 1
        if self.write_errors == 1:
            log.exception("room log: write failed in %s (records dropped and counted)", self.dir)
        self._drop(n)
        if self._fd is not None and not self._still_ours():
            self._replaced()

    def _cut_back(self, offset: int) -> None:
        """Truncate to `offset`; if even that fails, end this file (the reader rejects its torn tail)."""
        try:
            os.ftruncate(self._fd, offset)
        except OSError:
            log.warning("room log: cannot cut %s back after a failed write; continuing in a new file", self._files[-1])
            self._close_file()
            self._seq += 1

    def _still_ours(self) -> bool:
        """Whether our file is still at its path in the directory we opened (inode check)."""
        try:
            on_disk = os.stat(self._files[-1])
            mine = os.fstat(self._fd)
            directory = os.stat(self.dir)
        except OSError:
            return False
        return (on_disk.st_dev, on_disk.st_ino) == (mine.st_dev, mine.st_ino) and directory.st_ino == self._dir_ino

    def _replaced(self) -> None:
        """Our file or directory was deleted or replaced: what went into it since the last
        check is lost (counted as dropped, no longer as written); start a new file."""
        lost = self._unchecked
        self._unchecked = 0
        if lost:
            self.written -= lost
            self.lost += lost
            self._drop(lost)
        log.warning("room log: %s was deleted or replaced; %d record(s) lost, writing to a new file", self.dir, lost)
        self._close_file()
        self._files.pop()
        self._seq += 1

    def _open(self) -> None:
        if not self.dir.is_dir():
            self.dir.mkdir(parents=True, exist_ok=True)
            self.dir_recreated += 1
            log.warning("room log: directory %s was missing; recreated it", self.dir)
        self._dir_ino = os.stat(self.dir).st_ino
        path = self._path(self._seq)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size
        self._unchecked = 0
        self._files.append(path)

    def _close_file(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _rotate(self) -> None:
        opened = self._fd is not None
        if opened and not self._still_ours():
            self._replaced()
            opened = False
        self._close_file()
        self._unchecked = 0
        self._seq += 1
        self._size = 0
        closed = self._files[-1] if opened else None
        # The oldest go first, before the closed file is gzipped: its .gz appears beside it
        # before it is deleted, and the next file comes after, so there are never more
        # than max_files names on disk (the current file included).
        while len(self._files) >= self.max_files:
            oldest = self._files.pop(0)
            try:
                oldest.unlink()
            except FileNotFoundError:
                pass
        if closed is not None and self.gzip_rotated and self._files and self._files[-1] == closed:
            self._files[-1] = self._gzip(closed)

    def _gzip(self, path: Path) -> Path:
        target = path.with_name(path.name + ".gz")
        tmp = path.with_name(f".{path.name}.gz.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(path, "rb") as src, gzip.open(tmp, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
            os.replace(tmp, target)
            path.unlink()
            return target
        except OSError:
            log.exception("room log: could not gzip %s (kept uncompressed)", path)
            tmp.unlink(missing_ok=True)
            return path

    def _path(self, seq: int) -> Path:
        return self.dir / f"{self.stem}.{seq:06d}.jsonl"

    def _next_free_seq(self) -> int:
        """Continue after any file a previous process with the same stem left (pid reuse)."""
        seqs = [
            int(m.group(1))
            for p in self.dir.glob(f"{self.stem}.*.jsonl*")
            if (m := re.fullmatch(re.escape(self.stem) + r"\.(\d+)\.jsonl(\.gz)?", p.name))
        ]
        return max(seqs, default=0) + 1
