"""Where a pod would write its room logs, and whether it could.

A room log that cannot be written is lost, counted only in ``errors_total``; the
usual causes are a relative ``roomlog.dir`` resolved against the config file's
folder (in Kubernetes a read-only ConfigMap mount) or against whatever working
directory SGLang starts in, and a path on a read-only or pseudo file system. So
`check` tries what the writer will do: create the directory (and its missing
parents) and a file in it, then removes whatever it created.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LogDirVerdict:
    path: Path  # absolute
    origin: str  # how a relative value was resolved, "" when it was absolute
    problem: str | None  # why the probe could not write there, None when it can
    warning: str | None  # usable, but worth a second look


def examine(config) -> LogDirVerdict:
    try:
        raw = Path(config.roomlog.dir).expanduser()
    except RuntimeError:  # pathlib's answer to ~user of no known user, or ~ with no home
        problem = f"{config.roomlog.dir!r} starts with a '~' whose home directory is unknown here"
        return LogDirVerdict(Path(os.path.abspath(config.roomlog.dir)), "", problem, None)
    origin = ""
    if not raw.is_absolute():  # no config file, or DSV4_IDXK_PROBE_CONFIG unset: the servers' working directory
        raw = Path.cwd() / raw
        origin = "relative: the servers resolve it against their own working directory"
    elif config.source not in ("<defaults>", "") and _under(raw, Path(config.source).parent):
        origin = "inside the config file's folder, where a relative roomlog.dir is resolved"
    path = Path(os.path.abspath(raw))
    problem = _write_problem(path)
    warning = None
    if problem is None and origin.startswith("relative:"):
        warning = (f"roomlog.dir {config.roomlog.dir!r} is relative: each server writes under its own working "
                   f"directory (here {path}); set an absolute path on a writable volume")
    if problem is not None and origin.startswith("relative:"):
        problem += (f" (roomlog.dir {config.roomlog.dir!r} is relative: resolved here against this command's "
                    f"working directory, as each server resolves it against its own; set an absolute path)")
    if problem is not None and origin.startswith("inside the config"):
        problem += (" (a relative roomlog.dir is resolved against the config file's folder, in Kubernetes a "
                    "read-only ConfigMap mount: set an absolute path on a writable volume)")
    return LogDirVerdict(path, origin, problem, warning)


def _under(path: Path, folder: Path) -> bool:
    try:
        Path(os.path.abspath(path)).relative_to(os.path.abspath(folder))
        return True
    except ValueError:
        return False


def _write_problem(path: Path) -> str | None:
    """Why a file cannot be created in `path` by this user, or None; leaves nothing behind."""
    from ..roomlog.writer import directory_problem, missing_dirs

    created: list[Path] = []
    try:
        for d in missing_dirs(path):
            try:
                os.mkdir(d, 0o750)
            except OSError as exc:
                return f"{path} cannot be created ({d}: {exc.strerror or exc})"
            created.append(d)
        try:
            info = os.stat(path)
        except OSError as exc:
            return f"{path} cannot be read ({exc.strerror or exc})"
        why = directory_problem(info)
        if why:
            return f"{path} is refused by the room-log writer: {why}"
        try:
            fd, name = tempfile.mkstemp(prefix=".dsv4-idxk-probe-check-", dir=path)
        except OSError as exc:
            return f"no file can be created in {path} ({exc.strerror or exc})"
        os.close(fd)
        os.unlink(name)
        return None
    finally:
        for d in reversed(created):
            try:
                os.rmdir(d)
            except OSError:
                pass
