"""Background room-log writer: a bounded queue drained by one daemon thread.

The serving thread only calls `emit`, which never waits and never raises:
when the queue is full, or the directory cannot be used, the record is
dropped and counted (and ``dsv4_idxk_probe_records_dropped_total{sink="roomlog"}``
incremented when metrics are attached; a directory or file that cannot be
used is also counted in ``dsv4_idxk_probe_errors_total``). The thread
serialises, checksums and appends whole lines with one ``os.write`` per
batch, so a crash can tear at most the last line, which the reader skips and
counts as torn. Files rotate by size; the newest `max_files` are kept; rotated
files are optionally gzipped (temp file, then rename, so a reader never sees
half a .gz).

The directory may be shared with other writers and, at worst, with other
users, so the writer trusts no name in it (docs/security.md, "The room-log
directory"): it creates every file itself with ``O_CREAT | O_EXCL |
O_NOFOLLOW`` (a name that is taken, by another writer or by a planted link,
is skipped, never opened), compresses and deletes only files whose inode and
owner are still the ones it created, refuses a directory that someone else
could rewrite, and sets the modes of what it creates itself, whatever the
umask.
"""

from __future__ import annotations

import errno
import gzip
import logging
import os
import queue
import re
import shutil
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

from .lineformat import encode_line

log = logging.getLogger("dsv4_idxk_probe.roomlog")

_STOP = object()
_BATCH_LINES = 256
# Modes of what the writer creates, set with fchmod so the umask cannot widen (umask 0) or
# narrow them. Owner read/write; group read, for log shippers and operators added to the
# group; others nothing: the lines carry SGLang request ids, which tie rooms to users' requests.
DIR_MODE = 0o750
FILE_MODE = 0o640
_NAME_TRIES = 64  # taken names skipped in a row before an open counts as failed
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class DirectoryRefused(OSError):
    """The log directory is not one the writer may write into; the message says why."""


def _file_stem(role: str) -> str:
    """role-host-pid: one writer per process, so names rarely collide across pods; when they
    do (same host name and pid in two containers), O_EXCL gives each file to one writer."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"
    return f"{role}-{host}-{os.getpid()}"


def directory_problem(info: os.stat_result) -> str | None:
    """Why a directory with this stat must not hold room logs, or None.

    Refused: not a directory; owned by a user other than this process's and root (that user
    could delete, swap or plant files); writable by everyone without the sticky bit (anyone
    could). Group-writable directories are accepted (`group_writable` warns).
    """
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory"
    euid = os.geteuid()
    if info.st_uid not in (euid, 0):
        return (f"owned by uid {info.st_uid}, neither this process's user (uid {euid}) nor root: "
                f"that user could replace or read the logs")
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        return "writable by every user without the sticky bit: anyone could delete, replace or plant files in it"
    return None


def missing_dirs(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, outermost first."""
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    return missing[::-1]


def _make_dirs(path: Path) -> bool:
    """Create `path` and its missing parents with DIR_MODE (fchmod: the umask plays no part);
    True when `path` itself was created here. A directory another process creates meanwhile
    is left as it is (and checked like any existing one)."""
    created = False
    for d in missing_dirs(path):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            continue
        fd = os.open(d, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC)
        try:
            os.fchmod(fd, DIR_MODE)
        finally:
            os.close(fd)
        created = d == path
    return created


def _rename_no_replace(src: Path, dst: Path) -> None:
    """Rename `src` to `dst` unless `dst` exists (FileExistsError): a hard link, then the
    unlink; where the file system has no hard links, a check and a rename."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "file exists", str(dst)) from None
        os.replace(src, dst)
        return
    os.unlink(src)


class RoomLogWriter:
    """Append room records to ``<dir>/<role>-<host>-<pid>.<seq>.jsonl``.

    Call `close()` (or use it as a context manager) to drain the queue and stop
    the thread; `thread` is exposed so the owner can join it. Nothing about the
    directory raises here: a directory that is missing is created, one that
    cannot be used (a file, refused, unwritable) makes every batch a counted
    drop until it can be used (docs/roomlog.md, "Writer behaviour").
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
        self.stem = _file_stem(role)
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.gzip_rotated = gzip_rotated
        self.metrics = metrics
        self.dropped = 0  # queue full, closed, unserialisable, or not writable
        self.write_errors = 0  # batches that could not be written (directory refused, open or write failed)
        self.written = 0
        self.lost = 0  # counted as written, then found in a deleted or replaced file
        self.dir_recreated = 0
        self._unchecked = 0  # lines written since the file was last found in place
        self._dir_ino = 0
        self._logged: set[str] = set()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._closed = False
        self._count_lock = threading.Lock()
        self._fd: int | None = None
        self._size = 0
        self._files: list[Path] = []  # files of this writer, oldest first (current last)
        self._made: dict[Path, tuple[int, int, int]] = {}  # file -> (st_dev, st_ino, st_uid) as created
        try:  # create it now, so a refusal is in the log at start; writing checks it again
            fd, _ = self._open_dir()
            os.close(fd)
        except OSError as exc:
            self._log_once(f"open:{exc}", logging.ERROR,
                           "room log: cannot write in %s: %s (records will be dropped and counted until it can be used)",
                           self.dir, exc.strerror or exc)
        self._seq = self._next_free_seq()
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
        # What `Queue.put(record, block=False)` does, under the queue's own lock taken
        # directly: `put` runs seven Python frames (its condition's enter and exit, `_qsize`,
        # `_put`), and the probe's threads emit a record for every room stage.
        q = self._queue
        with q.mutex:
            full = len(q.queue) >= q.maxsize
            if not full:
                q.queue.append(record)
                q.unfinished_tasks += 1
                q.not_empty.notify()
        if full:
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

    def _count_error(self, site: str) -> None:
        """dsv4_idxk_probe_errors_total, when metrics are attached (never raises)."""
        if self.metrics is not None:
            try:
                self.metrics.count_error(site)
            except Exception:
                log.debug("errors metric failed", exc_info=True)

    def _log_once(self, key: str, level: int, message: str, *args, exc_info: bool = False) -> None:
        if key in self._logged:
            return
        if len(self._logged) < 64:
            self._logged.add(key)
        log.log(level, message, *args, exc_info=exc_info)

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
                self._count_error("roomlog.writer")
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
        except Exception:
            log.exception("room log writer failed")
            self._count_error("roomlog.writer")
        finally:
            for _ in rest:
                self._queue.task_done()

    def _write_batch(self, records: list) -> None:
        pending: list[bytes] = []
        pending_size = 0
        for record in records:
            try:
                line = encode_line(record)
            except Exception:  # not plain JSON, or nested past the encoders' depth (RecursionError): this record only
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
        except OSError as exc:
            self._write_failed(len(lines), exc, "roomlog.open")
            return
        start = self._size
        try:
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError as exc:
            self._cut_back(start)
            self._write_failed(len(lines), exc, "roomlog.write")
            return
        self._size += len(data)
        self.written += len(lines)
        self._unchecked += len(lines)

    def _write_failed(self, n: int, exc: OSError, site: str) -> None:
        self.write_errors += 1
        self._count_error(site)
        if isinstance(exc, DirectoryRefused) or site == "roomlog.open":
            self._log_once(f"open:{exc}", logging.ERROR, "room log: cannot write in %s: %s (records dropped and counted)",
                           self.dir, exc.strerror or exc)
        else:
            self._log_once("write", logging.ERROR, "room log: write failed in %s (records dropped and counted)",
                           self.dir, exc_info=True)
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

    def _is_made(self, path: Path, info: os.stat_result) -> bool:
        """Whether `info` (an lstat or fstat) is the file this writer created at `path`."""
        made = self._made.get(path)
        return made is not None and stat.S_ISREG(info.st_mode) and (info.st_dev, info.st_ino, info.st_uid) == made

    def _still_ours(self) -> bool:
        """Whether our file is still at its path in the directory we opened (inode check)."""
        try:
            on_disk = os.lstat(self._files[-1])
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
        self._made.pop(self._files.pop(), None)  # whatever is at that name now is not ours
        self._seq += 1

    def _open_dir(self) -> tuple[int, bool]:
        """(fd of the log directory, whether it was created now): created with DIR_MODE if
        missing, then checked by fd (`directory_problem`; DirectoryRefused)."""
        created = _make_dirs(self.dir)
        fd = os.open(self.dir, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
        try:
            info = os.fstat(fd)
            problem = directory_problem(info)
            if problem:
                raise DirectoryRefused(errno.EPERM, problem)
            if info.st_mode & stat.S_IWGRP:
                self._log_once("group-writable", logging.WARNING,
                               "room log: %s is group-writable: members of group %d can delete or rename the logs",
                               self.dir, info.st_gid)
        except BaseException:
            os.close(fd)
            raise
        if not self._dir_ino:
            self._dir_ino = info.st_ino
        return fd, created

    def _open(self) -> None:
        had_dir = bool(self._dir_ino)
        dir_fd, created = self._open_dir()
        try:
            if created and had_dir:
                self.dir_recreated += 1
                log.warning("room log: directory %s was missing; recreated it", self.dir)
            self._dir_ino = os.fstat(dir_fd).st_ino
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | _O_NOFOLLOW | _O_CLOEXEC
            for _ in range(_NAME_TRIES):
                path = self._path(self._seq)
                try:
                    fd = os.open(path.name, flags, FILE_MODE, dir_fd=dir_fd)
                except FileExistsError:  # another writer's file, a left-over or a planted link: never opened
                    self._seq += 1
                    continue
                try:
                    os.lstat(path.name + ".gz", dir_fd=dir_fd)
                except FileNotFoundError:
                    break
                # Another writer of this stem had the name and has compressed it (the .gz is in
                # place before the name is freed): ours would be compressed onto its .gz.
                os.close(fd)
                os.unlink(path.name, dir_fd=dir_fd)
                self._seq += 1
            else:
                raise OSError(errno.EEXIST, f"{_NAME_TRIES} file names in a row were taken (last {path.name})")
        finally:
            os.close(dir_fd)
        try:
            os.fchmod(fd, FILE_MODE)
            info = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        self._size = 0
        self._unchecked = 0
        self._files.append(path)
        self._made[path] = (info.st_dev, info.st_ino, info.st_uid)

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
            self._remove(self._files.pop(0))
        if closed is not None and self.gzip_rotated and self._files and self._files[-1] == closed:
            kept = self._gzip(closed)
            if kept is None:
                self._files.pop()
            else:
                self._files[-1] = kept

    def _remove(self, path: Path) -> None:
        """Delete one of our old files, only if the name still holds the file we created."""
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            self._made.pop(path, None)
            return
        except OSError:
            log.warning("room log: cannot check %s before deleting it; left alone", path, exc_info=True)
            return
        if not self._is_made(path, info):
            log.warning("room log: %s is no longer the file this writer made; left alone", path)
        else:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError:
                log.warning("room log: cannot delete %s", path, exc_info=True)
        self._made.pop(path, None)

    def _gzip(self, path: Path) -> Path | None:
        """Compress our closed file to `<name>.gz` (FILE_MODE); the path kept, or None when the
        name no longer holds the file we made (then it is neither read nor deleted)."""
        try:
            src = os.open(path, os.O_RDONLY | _O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC)
        except OSError as exc:
            log.warning("room log: %s cannot be reopened to compress it (%s); not compressed, left alone",
                        path, exc.strerror or exc)
            self._made.pop(path, None)
            return None
        target = path.with_name(path.name + ".gz")
        tmp = path.with_name(f".{path.name}.gz.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with os.fdopen(src, "rb") as source:
                if not self._is_made(path, os.fstat(source.fileno())):  # checked by fd: what we read is ours
                    log.warning("room log: %s is no longer the file this writer made; not compressed, left alone", path)
                    self._made.pop(path, None)
                    return None
                dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, FILE_MODE)
                with os.fdopen(dst, "wb") as raw:
                    os.fchmod(raw.fileno(), FILE_MODE)
                    info = os.fstat(raw.fileno())
                    with gzip.GzipFile(filename=path.name, mode="wb", fileobj=raw, compresslevel=6) as out:
                        shutil.copyfileobj(source, out)
            _rename_no_replace(tmp, target)
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                log.warning("room log: %s already exists; %s kept uncompressed", target, path)
            else:
                log.exception("room log: could not gzip %s (kept uncompressed)", path)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return path
        self._made[target] = (info.st_dev, info.st_ino, info.st_uid)
        self._remove(path)
        return target

    def _path(self, seq: int) -> Path:
        return self.dir / f"{self.stem}.{seq:06d}.jsonl"

    def _next_free_seq(self) -> int:
        """Continue after any file a previous process with the same stem left (pid reuse);
        names taken meanwhile are skipped when the file is created (O_EXCL)."""
        try:
            seqs = [
                int(m.group(1))
                for p in self.dir.glob(f"{self.stem}.*.jsonl*")
                if (m := re.fullmatch(re.escape(self.stem) + r"\.(\d+)\.jsonl(\.gz)?", p.name))
            ]
        except OSError:
            seqs = []
        return max(seqs, default=0) + 1
