"""HiCacheFile's files: where a stored page lives, which version of it is there, and
how a sidecar that outlived its page is taken away.

Why: ``HiCacheFile.set`` skips a key that exists, and its evictor removes a page's
file and its sidecar's independently. A sidecar that outlives its page would stay
when the same key is stored again, and the new page's restore would be compared
with the old page's digests: a false mismatch wherever the two pages' bytes differ.
So a page the backend stores anew takes its old sidecar away at once (its restore
is `digest_lost` until the new sidecar is written), a sidecar is written only while
the page it describes is still the one on disk, and only when that file holds the
bytes the write stored (another process may have stored the key in the same instant);
and a sidecar names the page version it describes, which a read checks: a sidecar of
another version (the page stored again while the probe was off, or by a writer it did
not see) is no sidecar.

SGLang knowledge (every release 0.5.18-0.5.23): a page of ``pool_name`` under
``key`` is the file ``<file_path>/<_get_suffixed_key(_log_key(pool_name, key))>.bin``;
``set`` writes a temporary file and ``os.replace``-s it over the page, so a page
stored anew is a new file (a new inode); ``exists`` may answer from
``metadata_cache``, which must forget a file the probe removes.
"""

from __future__ import annotations

import array
import fcntl
import os
import threading
from typing import Callable, Sequence

import numpy as np

#: A stored file's version: (inode, the inode's generation, size, modification time in ns);
#: None: no file. The generation tells apart two files that got the same inode number one
#: after the other (ext4 hands a freed inode out again at once), where a modification time
#: may not (the kernel's file clock moves in ticks of 1-10 ms before 6.13); 0 where the file system
#: keeps none, and then the other three decide.
FileVersion = tuple[int, int, int, int]
#: _IOR('v', 1, long) as x86-64 and aarch64 number it (where SGLang serves; elsewhere the call
#: fails and the generation reads 0): answered by ext2/3/4, XFS and btrfs
_FS_IOC_GETVERSION = 0x80087601


def stored_path(backend, storage_key: str) -> str:
    """The file that holds `storage_key` (a key before the backend's config suffix)."""
    return os.path.join(backend.file_path, f"{backend._get_suffixed_key(storage_key)}.bin")


def page_path(backend, pool_name, key) -> str:
    """The file that holds the page of `pool_name` stored under `key`."""
    return stored_path(backend, backend._log_key(pool_name, key))


def file_version(path: str) -> FileVersion | None:
    """The file's version, or None when there is none (an open, a stat and an ioctl)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return _version(fd, os.fstat(fd))
    except OSError:
        return None
    finally:
        os.close(fd)


def stored_size(path: str) -> int | None:
    """The size of the file at `path`, None when there is none (one stat)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _version(fd: int, st: os.stat_result) -> FileVersion:
    return st.st_ino, _generation(fd), st.st_size, st.st_mtime_ns


def _generation(fd: int) -> int:
    buf = array.array("i", [0])  # the file systems answer with a 32-bit int
    try:
        fcntl.ioctl(fd, _FS_IOC_GETVERSION, buf, True)
    except OSError:  # not kept by this file system (overlayfs, tmpfs, network file systems)
        return 0
    return int(buf[0]) & 0xFFFFFFFF


def head(path: str, nbytes: int) -> bytes | None:
    """The first `nbytes` of the file at `path`, None when there is no file."""
    try:
        with open(path, "rb", buffering=0) as f:
            return f.read(nbytes)
    except OSError:
        return None


def holding(path: str, parts: Sequence[np.ndarray]) -> FileVersion | None:
    """The version of the file at `path` if it holds exactly the bytes of `parts` (uint8
    arrays, one after the other), else None. Read through one open file, so the version and
    the bytes are the same file's. Why: a page's file can be another writer's (a second
    process storing the same key in the same instant: ``set``'s own ``os.replace`` and the
    other's land in either order), and a sidecar must describe the bytes that are on disk."""
    size = sum(part.size for part in parts)
    got = _scratch("got", size)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_size != size or not _read_fully(fd, got):
            return None
        version = _version(fd, st)
    except OSError:
        return None
    finally:
        os.close(fd)
    want = np.concatenate(parts, out=_scratch("want", size))
    if size % 8 == 0:  # eight bytes a compare
        got, want = got.view(np.uint64), want.view(np.uint64)
    return version if np.array_equal(got, want) else None


def _read_fully(fd: int, into: np.ndarray) -> bool:
    done = 0
    while done < into.size:
        n = os.preadv(fd, [into[done:]], done)
        if not n:
            return False
        done += n
    return True


_scratches = threading.local()  # per storage thread: the page as read, the page as stored


def _scratch(name: str, size: int) -> np.ndarray:
    """A buffer of `size` bytes kept by this thread (a page's size: allocated once, not per page)."""
    buf = getattr(_scratches, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(size, dtype=np.uint8)
        setattr(_scratches, name, buf)
    return buf[:size]


def stored_anew(before: FileVersion | None, after: FileVersion | None) -> bool:
    """Whether a ``_write_page`` call stored its page: a file is there and it is another
    than before the call (``set`` skipped a page that existed: the same file)."""
    return after is not None and after != before


def remove_stored(backend, storage_key: str) -> None:
    """Take a stored file away: the file first, then the metadata cache's entry (the other
    order widens the window in which a concurrent ``exists`` puts the entry back while the
    file is still there, and a later ``set`` of the key is skipped: docs/hicache.md's known
    limits). The evictor tolerates a missing file."""
    try:
        os.remove(stored_path(backend, storage_key))
    except FileNotFoundError:
        pass
    _forget_cached(backend, storage_key)


def set_anew(backend, storage_key: str, value) -> bool:
    """The backend's ``set`` of a key the probe took away (`remove_stored`), its metadata
    cache's entry forgotten first: a call that saw the old file just before it went (the
    backend's ``exists``) can have put the entry back, and ``set`` would then skip the key
    for the cache's TTL. Narrows that window to the microseconds between the forget and the
    ``set``. A file of the key that is there (another writer's) is still kept, as ``set``
    keeps one."""
    _forget_cached(backend, storage_key)
    return backend.set(storage_key, value)


def _forget_cached(backend, storage_key: str) -> None:
    """Take `storage_key` out of the backend's metadata cache, where it keeps one."""
    cache = getattr(backend, "metadata_cache", None)
    if cache is not None:
        cache.remove(backend._get_suffixed_key(storage_key))


def write_while_current(backend, sidecar_key: str, page: str, version: FileVersion,
                        write: Callable[[], object]) -> bool:
    """Write a page's sidecar only while `page` is still at `version`: checked before the
    write, and after it (a page stored anew in between took its own sidecar's place away,
    perhaps before this write landed, so this one goes too). True when written and current."""
    if file_version(page) != version:
        return False
    write()
    if file_version(page) != version:
        remove_stored(backend, sidecar_key)
        return False
    return True
