"""Read a small regular file whose path an operator gave: bounded, never hanging.

Config files, fault specs and secret files are named by operators, so the
path may be a FIFO (which would block a plain open), a device such as
/dev/zero (which never ends) or a huge file. Each is refused with a message
naming the file, raised as the caller's own error type.
"""

from __future__ import annotations

import os
import stat
from typing import Callable


def read_bounded(path: str | os.PathLike, what: str, max_bytes: int, error: type[Exception],
                 inspect: Callable[[os.stat_result], None] | None = None) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes`; any problem raises `error`
    with a message naming the file and `what` it was meant to be.

    `inspect`, when given, sees the open file's `os.fstat` before anything is read
    (the same file that is then read, not the path again) and may raise `error`
    itself, e.g. to refuse a secret anyone may write.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # non-blocking: a FIFO never hangs the caller
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{path}: cannot read {what}: not a regular file")
        if info.st_size > max_bytes:
            raise error(f"{path}: {what} is {info.st_size:,} bytes, over the {max_bytes:,}-byte limit")
        if inspect is not None:
            inspect(info)
        chunks, size = [], 0
        while True:  # the size can change under us: read at most one byte past the cap
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise error(f"{path}: {what} grew over the {max_bytes:,}-byte limit while read")
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def read_bounded_text(path: str | os.PathLike, what: str, max_bytes: int, error: type[Exception]) -> str:
    """`read_bounded`, decoded as UTF-8; text that is not UTF-8 raises `error` naming the byte."""
    data = read_bounded(path, what, max_bytes, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: {what} is not UTF-8 text (byte {exc.start})") from None
