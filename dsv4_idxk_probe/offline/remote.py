"""Room logs named by URL (`s3://bucket/day/**/*.jsonl*`, `https://...`), for the fleet engine.

DuckDB's httpfs extension lists and fetches them: it must be installed already
(`INSTALL httpfs` once, where the machine can reach the extension repository; this tool
never downloads an extension) and credentials come from DuckDB's own settings or the
environment (`CREATE SECRET`, AWS_* variables). Each file is copied into a local folder
under --temp-dir, because every line's checksum is verified in Python and the reference
reader reads the files it cannot trust; everything the tools print names the URL.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..roomlog.reader import InputError

_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.I)
_LOG_SUFFIXES = (".jsonl", ".jsonl.gz")


def is_url(arg: str) -> bool:
    return bool(_URL.match(arg))


def _connect():
    import duckdb

    con = duckdb.connect(config={"autoinstall_known_extensions": False})  # never a download
    try:
        con.execute("LOAD httpfs")
    except Exception as exc:  # duckdb.Error and its kin: not installed, or cannot load
        raise InputError(f"URLs need DuckDB's httpfs extension, which is not installed here "
                         f"(INSTALL httpfs, once, where the extension repository can be reached): {exc}") from None
    return con


def expand_urls(args: list[str]) -> list[str]:
    """The log files the URL arguments name: a glob through DuckDB's `glob()`, a folder
    ending in `/` as every *.jsonl[.gz] under it, anything else as one file; each once."""
    if not args:
        return []
    con = _connect()
    out: list[str] = []
    seen: set[str] = set()
    try:
        for arg in args:
            pattern = arg + "**" if arg.endswith("/") else arg
            if any(c in pattern for c in "*?["):
                found = [row[0] for row in con.execute("SELECT file FROM glob(?) ORDER BY file", [pattern]).fetchall()]
                found = [f for f in found if f.endswith(_LOG_SUFFIXES)]
                if not found:
                    raise InputError(f"{arg}: glob matches no *.jsonl or *.jsonl.gz file")
            else:
                found = [arg]
            for url in found:
                if url not in seen:
                    seen.add(url)
                    out.append(url)
    finally:
        con.close()
    return out


def fetch(urls: list[str], folder: Path) -> list[tuple[Path, str]]:
    """Copy each URL into `folder`; (local copy, URL) pairs in the same order."""
    if not urls:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    con = _connect()
    pairs = []
    try:
        for i, url in enumerate(urls):
            local = folder / f"{i:06d}-{os.path.basename(url.rstrip('/'))[-100:] or 'log'}"
            try:
                rows = con.execute("SELECT content FROM read_blob(?)", [url]).fetchall()
            except Exception as exc:
                raise InputError(f"{url}: cannot read: {exc}") from None
            local.write_bytes(bytes(rows[0][0]) if rows else b"")
            pairs.append((local, url))
    finally:
        con.close()
    return pairs
