"""Write a file all at once: the CLI's one way to replace a file others read.

A temp file in the same directory, then a rename: a reader (a web server, a
Grafana provisioner, the interpreter reading a .pth) never sees half a file.
The mode is set on the open file, so it does not depend on the umask
(mkstemp makes 0600); 0644 by default, since every file the CLI writes is
meant to be read by others.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

SHARED_MODE = 0o644


def write_atomically(path: str | os.PathLike, data: bytes | str, *, mode: int = SHARED_MODE) -> None:
    """Replace `path` with `data` (text is written as UTF-8); raises OSError, leaving no temp file.

    A symlink is written through (the file it names is replaced, the link stays). Anything
    but a regular file there (a device, a FIFO, a directory) is refused: the rename would put
    a plain file in its place (`-o /dev/full` replaced the device node)."""
    target = Path(path)
    if target.is_symlink():
        target = target.resolve()
    try:
        st = os.stat(target)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file (only a file is replaced)", str(path))
    payload = data.encode("utf-8", errors="backslashreplace") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", suffix=".tmp", dir=target.parent.resolve())
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
