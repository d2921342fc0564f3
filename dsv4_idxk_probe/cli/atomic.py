"""Write a file all at once: the CLI's one way to replace a file others read.

A temp file in the same directory, then a rename: a reader (a web server, a
Grafana provisioner, the interpreter reading a .pth) never sees half a file.
The mode is set on the open file, so it does not depend on the umask
(mkstemp makes 0600); 0644 by default, since every file the CLI writes is
meant to be read by others.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

SHARED_MODE = 0o644


def write_atomically(path: str | os.PathLike, data: bytes | str, *, mode: int = SHARED_MODE) -> None:
    """Replace `path` with `data` (text is written as UTF-8); raises OSError, leaving no temp file."""
    target = Path(path)
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
