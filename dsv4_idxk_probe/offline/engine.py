"""Which join `diff` and `report` run: the reference (`join.analyse`, one Python process)
or the fleet engine on DuckDB (`fleet.analyse_fleet`), and the options they share.

`--engine auto` (the default) takes DuckDB when it is installed and the inputs hold at
least `AUTO_BYTES` (a fleet's day), or when an option only the fleet engine has is
given (`--since`, `--until`, `--instance`, `--per-instance`); small inputs stay on the
reference join, which starts faster. Without DuckDB the reference join runs and the
tool says so once on stderr; the fleet-only options then exit 2 (docs/fleet.md).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import shutil
import tempfile

from ..background import every
from ..roomlog.reader import InputError, expand_inputs
from . import fleet, remote
from .argtypes import whole_number
from .diff_output import write_json
from .join import analyse
from .printable import printable, printable_logs
from .results import Analysis

AUTO_BYTES = 1 << 30
INSTALL = "pip install 'dsv4-idxk-probe[fleet]'"


def parse_time(text: str) -> float:
    """Unix seconds, or an ISO 8601 time (UTC when it names no zone); a finite number (`nan`
    compared false with every record's time, and the window silently kept some rooms only)."""
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite time")
        return value
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither Unix seconds nor an ISO 8601 time") from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.timestamp()


def add_engine_arguments(parser: argparse.ArgumentParser, *, per_instance: bool = True) -> None:
    group = parser.add_argument_group("fleet (many pods; DuckDB, the `fleet` extra: docs/fleet.md)")
    group.add_argument("--engine", choices=("auto", "duckdb", "reference"), default="auto",
                       help="the join: DuckDB (all cores, bounded memory) or the reference Python join; "
                            "auto: DuckDB for inputs over 1 GiB or the options below (default)")
    group.add_argument("--since", type=parse_time, metavar="TIME",
                       help="only rooms with a decode record at or after TIME (Unix seconds or ISO 8601, UTC)")
    group.add_argument("--until", type=parse_time, metavar="TIME", help="only rooms with a decode record before TIME")
    group.add_argument("--instance", action="append", metavar="GLOB",
                       help="only rooms with a record written by a matching instance (host:pid, glob); repeatable")
    if per_instance:
        group.add_argument("--per-instance", action="store_true",
                           help="a summary per writer instance (table, and `instances` in --json)")
    group.add_argument("--memory-limit", type=memory_limit, default=fleet.DEFAULT_MEMORY_LIMIT, metavar="SIZE",
                       help=f"DuckDB's memory limit, at least 64MB; it spills to --temp-dir beyond it "
                            f"({fleet.DEFAULT_MEMORY_LIMIT})")
    group.add_argument("--threads", type=whole_number(1, MAX_THREADS), metavar="N",
                       help=f"DuckDB threads, 1-{MAX_THREADS} (default: all cores)")
    group.add_argument("--temp-dir", type=writable_dir, metavar="DIR",
                       help="where DuckDB's database and spill files go, a writable folder (default: $TMPDIR)")


MAX_THREADS = 1024  # DuckDB makes a state per thread: 100,000 ran for minutes on a 60 KB input
MIN_MEMORY_BYTES = 64 << 20  # below that DuckDB cannot run the join at all


def memory_limit(text: str) -> str:
    """DuckDB's spelling of a size (512MB, 4GiB), checked here: an unreadable or tiny one was
    an internal error (exit 3), after the run had started."""
    size = fleet.table_route.size_bytes(text)
    if size is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (such as 512MB or 4GiB)")
    if size < MIN_MEMORY_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is below 64MB, too little for the join")
    return text.strip()


def writable_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder this user can write")
    return text


def _fleet_only(args: argparse.Namespace) -> list[str]:
    used = []
    if args.since is not None:
        used.append("--since")
    if args.until is not None:
        used.append("--until")
    if args.instance:
        used.append("--instance")
    if getattr(args, "per_instance", False):
        used.append("--per-instance")
    return used


def expand(args: list[str]) -> list:
    """The inputs: local files (`expand_inputs`: files, directories, globs) as Paths, and
    URLs (`s3://...`, fetched by the fleet engine through DuckDB's httpfs) kept as text."""
    local = [a for a in args if not remote.is_url(a)]
    urls = [a for a in args if remote.is_url(a)]
    return (expand_inputs(local) if local else []) + urls


def _size(paths: list[Path]) -> int:
    total = 0
    for p in paths:
        try:
            total += os.stat(p).st_size
        except OSError:
            pass
    return total


#: Loggers that can log log data (file names) while the logs are read: made printable meanwhile.
LOGGERS = ("dsv4_idxk_probe", "dsv4_idxk_probe.roomlog", "dsv4_idxk_probe.offline")


def analyse_inputs(args: argparse.Namespace, prefix: str, reference=None) -> Analysis | None:
    """`diff`'s and `report`'s reading of `args.logs`: the inputs expanded, then `run`, with the
    reader's warnings (which name files and lines) made printable; None after a message."""
    try:
        paths = expand(args.logs)  # URLs stay text: the fleet engine fetches them
    except InputError as exc:
        print(f"{prefix} {printable(exc)}", file=sys.stderr)
        return None
    with printable_logs(*LOGGERS):
        return run(paths, args, prefix, reference=reference)


def run(paths: list[Path], args: argparse.Namespace, prefix: str, reference=None) -> Analysis | None:
    """The analysis by the engine `args` ask for; None (after a message) when it cannot run.
    `reference` is the reference join to call (default `join.analyse`)."""
    fleet_only = _fleet_only(args)
    if any(isinstance(p, str) for p in paths):
        fleet_only.append("URLs")
    engine = args.engine
    if engine == "auto":
        engine = "duckdb" if fleet_only or _size(paths) >= AUTO_BYTES else "reference"
    if engine == "duckdb" and not fleet.available():
        if fleet_only:
            print(f"{prefix} {', '.join(fleet_only)} need DuckDB, which is not installed ({INSTALL})", file=sys.stderr)
            return None
        print(f"{prefix} note: DuckDB is not installed ({INSTALL}); using the reference join "
              "(one process, memory grows with the rooms)", file=sys.stderr)
        engine = "reference"
    if engine == "reference":
        if fleet_only:
            print(f"{prefix} {', '.join(fleet_only)} need the DuckDB engine (--engine duckdb or auto)", file=sys.stderr)
            return None
        with _heartbeat(prefix, "reference join"):
            return (reference or analyse)(paths)

    def progress(message: str) -> None:
        print(f"{prefix} {message}", file=sys.stderr, flush=True)

    urls = [p for p in paths if isinstance(p, str)]
    names: dict[str, str] = {}
    fetched = None
    if urls:
        fetched = tempfile.mkdtemp(prefix="dsv4-fleet-remote-", dir=args.temp_dir)
        try:
            pairs = remote.fetch(remote.expand_urls(urls), Path(fetched))
        except InputError as exc:
            shutil.rmtree(fetched, ignore_errors=True)
            print(f"{prefix} {printable(exc)}", file=sys.stderr)
            return None
        except BaseException:
            shutil.rmtree(fetched, ignore_errors=True)
            raise
        names = {str(local): url for local, url in pairs}
        paths = [p for p in paths if not isinstance(p, str)] + [local for local, _ in pairs]
    try:
        analysis = _fleet(paths, args, progress, names)
    except BaseException:
        if fetched:
            shutil.rmtree(fetched, ignore_errors=True)
        raise
    analysis.fetched_dir = fetched
    return analysis


def _fleet(paths: list, args: argparse.Namespace, progress, names: dict) -> Analysis:
    return fleet.analyse_fleet(
        names=names,
        paths=paths,
        filters=fleet.Filters(args.since, args.until, tuple(args.instance or ())),
        memory_limit=args.memory_limit,
        threads=args.threads,
        temp_dir=args.temp_dir,
        progress=progress,
        per_instance=getattr(args, "per_instance", False),
    )


def write_any_json(analysis: Analysis, path: str, status: int) -> None:
    """`diff --json` by whichever engine made `analysis`."""
    if isinstance(analysis, fleet.FleetAnalysis):
        fleet.write_fleet_json(analysis, path, status)
    else:
        write_json(analysis, path, status)


def close(analysis: Any) -> None:
    if isinstance(analysis, fleet.FleetAnalysis):
        analysis.close()
        if getattr(analysis, "fetched_dir", None):
            shutil.rmtree(analysis.fetched_dir, ignore_errors=True)


def print_per_instance(analysis: Analysis, out, show=printable) -> None:
    rows = getattr(analysis, "per_instance", None)
    if not rows:
        return
    print("\nper instance (role, records, rooms, room verdicts):", file=out)
    for row in rows:
        verdicts = ", ".join(f"{v} {n:,}" for v, n in row["room_verdicts"].items()) or "-"
        print(f"  {show(row['instance'])}  {row['role']}  {row['records']:,} records  {row['rooms']:,} rooms  "
              f"{verdicts}", file=out)


def _heartbeat(prefix: str, what: str, first_s: float = 2.0, every_s: float = 10.0):
    """A line on stderr after `first_s` and every `every_s` while `what` runs: the reference
    join reports no counts of its own, and a silent minute reads as a hang."""
    started = time.monotonic()

    def say() -> None:
        print(f"{prefix} {what}: still reading ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)

    return every(every_s, say, first=first_s, name="dsv4-idxk-probe-progress")
