"""`analyse_fleet`: scan, ingest, classify, judge and merge, with progress.

Where the native room table can judge the clean keys (`table_route`), no DuckDB runs: the
table folds the native pass's rows, the reference joiner reads the complex keys' records.
Otherwise (or past the table's memory budget, starting over) the steps below run.

The scan (Python, holds the GIL) runs while DuckDB ingests the batch before it (DuckDB
releases the GIL): one worker thread owns the connection until the scan ends. Memory is
bounded by DuckDB's `memory_limit` (it spills to `temp_dir`) plus one file chunk in the
scan and the complex keys' joined state.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from ..join import prefill_files_first
from .analysis import FleetAnalysis, FleetStats
from .classify import classify
from .duck import DEFAULT_MEMORY_LIMIT, connect, insert_rows
from .filters import Filters
from .ingest import ingest_batch, slow_file_keys
from .ingest_native import ingest_native_batch
from . import native as native_pass
from .ingest_sql import SCHEMA
from .instances import clean_coverage, per_instance as per_instance_summary
from .judge import judge_complex
from .scan import FileScan, scan_file
from .summary import merge, merge_table
from . import table_route

BATCH_BYTES = 512 << 20  # fast files handed to DuckDB per ingest query (text bytes)
BATCH_FILES = 256
BATCH_ROWS = 400_000  # native rows handed to DuckDB per insert (~100 bytes each until then)


class Progress:
    """Progress lines, at most one every `every` seconds unless forced."""

    def __init__(self, out: Callable[[str], None] | None, every: float = 2.0):
        # last: -inf, not 0.0 (the monotonic clock starts near 0 at boot: the first line must show)
        self.out, self.every, self.last, self.start = out, every, -math.inf, time.monotonic()

    def __call__(self, message: str, force: bool = False) -> None:
        if self.out is None:
            return
        now = time.monotonic()
        if force or now - self.last >= self.every:
            self.last = now
            self.out(f"[{now - self.start:6.1f} s] {message}")


def analyse_fleet(
    paths: Iterable[Path],
    *,
    filters: Filters | None = None,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
    threads: int | None = None,
    temp_dir: str | None = None,
    progress: Callable[[str], None] | None = None,
    per_instance: bool = False,
    names: dict[str, str] | None = None,
) -> FleetAnalysis:
    """The reference's findings over any number of files, with DuckDB (or the native room
    table) doing the bulk.

    The caller closes the result (`close()`) once its JSON is written: the clean rooms
    stay in DuckDB (or the table) until then."""
    paths = list(paths)
    native = native_pass.module()
    names = names or {}  # local copy -> what to call it (a URL fetched by `remote`)
    filters = filters or Filters()
    say = Progress(progress)
    say(native_pass.describe(), force=True)
    why_not = table_route.why_not(native, filters, per_instance)
    fallbacks = 0
    if why_not is None:
        try:
            return _with_table(paths, native, names, say, table_route.budget_bytes(memory_limit), filters)
        except table_route.OverBudget as exc:
            fallbacks = 1
            why_not = str(exc)
            say(f"{why_not}: starting over with DuckDB judging the clean keys", force=True)
    say(f"clean keys judged by DuckDB ({why_not})", force=True)
    analysis = _with_duckdb(paths, native, names, say, filters, memory_limit, threads, temp_dir, per_instance)
    analysis.stats.clean_judge = f"DuckDB ({why_not})"
    analysis.stats.table_fallbacks = fallbacks
    return analysis


def _begin(paths: list, names: dict) -> tuple:
    def name(p) -> str:
        return names.get(str(p), str(p))

    analysis = FleetAnalysis(files=[name(p) for p in paths])
    analysis.stats.files = len(paths)
    ordered = sorted(paths, key=prefill_files_first)
    analysis.ordered_files = [name(p) for p in ordered]
    file_rank = {name(p): i for i, p in enumerate(ordered)}
    return analysis, name, ordered, file_rank


def _with_table(paths: list, native, names: dict, say, budget: int, filters: Filters) -> FleetAnalysis:
    """Clean keys judged and written by the native room table; the reference joiner reads
    the complex keys' records. No DuckDB."""
    analysis, name, ordered, file_rank = _begin(paths, names)
    stats = analysis.stats
    stats.clean_judge = "room table"
    say("clean keys judged by the native room table", force=True)
    t0 = time.monotonic()
    table = table_route.new_table()
    scans, py_records, odd_positions = table_route.scan_into(table, ordered, name, stats, say, native, budget,
                                                             filters)
    stats.seconds["scan_and_ingest"] = time.monotonic() - t0
    stats.table_bytes = table.nbytes
    say(f"scanned {len(ordered):,} files: {stats.canonical_records:,} canonical room records, "
        f"{stats.odd_lines:,} other lines; {len(table):,} keys in the room table ({stats.table_bytes:,} bytes)",
        force=True)
    t1 = time.monotonic()
    table.mark_complex(py_records)
    judged = table.counts()
    stats.clean_keys = judged["clean"] + judged["prefill_only"]
    stats.complex_keys = judged["complex"]
    wanted = table_route.wanted_lines(table, odd_positions)
    stats.seconds["classify"] = time.monotonic() - t1
    say(f"{stats.clean_keys:,} clean keys judged by the room table, {stats.complex_keys:,} for the reference join",
        force=True)
    analysis.table = table
    try:
        t2 = time.monotonic()
        first_prefill, _ = judge_complex(None, scans, analysis, filters, say, name, wanted=wanted,
                                         complex_keys=table.complex_keys() if filters.active else None)
        stats.seconds["python_join"] = time.monotonic() - t2
        t3 = time.monotonic()
        merge_table(table_route.counts(table), analysis, first_prefill, file_rank)
        analysis.clean_coverage = table_route.coverage(table)
        stats.seconds["merge"] = time.monotonic() - t3
        say(f"judged: {len(analysis.rooms):,} rooms in Python, {analysis.clean_rooms:,} clean in the room table",
            force=True)
    except BaseException:
        analysis.close()
        raise
    return analysis


def _with_duckdb(paths: list, native, names: dict, say, filters: Filters, memory_limit: str, threads, temp_dir,
                 per_instance: bool) -> FleetAnalysis:
    analysis, name, ordered, file_rank = _begin(paths, names)
    stats = analysis.stats
    t0 = time.monotonic()
    con, analysis.workdir = connect(memory_limit, threads, temp_dir)
    analysis.con = con
    try:
        con.execute(SCHEMA)
        py_keys: set = set()
        scans = _scan_and_ingest(con, ordered, name, stats, py_keys, say, native)
        stats.seconds["scan_and_ingest"] = time.monotonic() - t0
        say(f"scanned {len(ordered):,} files: {stats.canonical_records:,} canonical room records, "
            f"{stats.odd_lines:,} other lines; classifying", force=True)

        t1 = time.monotonic()
        if py_keys:
            insert_rows(con, "pykeys", ("room", "attempt"), list(py_keys))
        classify(con, filters)
        stats.seconds["classify"] = time.monotonic() - t1
        stats.clean_keys, stats.complex_keys = con.execute(
            "SELECT (SELECT count(*) FROM clean) + (SELECT count(*) FROM clean_po), (SELECT count(*) FROM complex)").fetchall()[0]
        say(f"{stats.clean_keys:,} clean keys judged in SQL, {stats.complex_keys:,} for the reference join", force=True)

        t2 = time.monotonic()
        first_prefill, instances_py = judge_complex(con, scans, analysis, filters, say, name)
        stats.seconds["python_join"] = time.monotonic() - t2
        t3 = time.monotonic()
        merge(con, analysis, first_prefill, file_rank)
        analysis.clean_coverage = clean_coverage(con)
        if per_instance:
            analysis.per_instance = per_instance_summary(con, analysis, instances_py)
        stats.seconds["merge"] = time.monotonic() - t3
        say(f"judged: {len(analysis.rooms):,} rooms in Python, {analysis.clean_rooms:,} clean in SQL", force=True)
    except BaseException:
        analysis.close()
        raise
    return analysis


def _scan_and_ingest(con, ordered: list[Path], name, stats: FleetStats, py_keys: set, say,
                     native=None) -> list[FileScan]:
    """Scan every file in reading order (the native pass when `native`); hand fast files to
    DuckDB in batches and slow files' keys to the Python join, on a worker thread that owns
    the connection."""
    scans: list[FileScan] = []
    batch: list[FileScan] = []
    batch_bytes = 0
    jobs: queue.Queue = queue.Queue(maxsize=1)
    failed: list[BaseException] = []

    def worker() -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            if failed:
                continue
            try:
                kind, item = job
                if kind == "batch":
                    ingest_batch(con, item, stats, py_keys)
                elif kind == "native":
                    ingest_native_batch(con, item, stats, py_keys)
                else:
                    slow_file_keys(item, py_keys, con)
            except BaseException as exc:  # re-raised by the scanning thread
                failed.append(exc)

    thread = threading.Thread(target=worker, name="dsv4-fleet-ingest", daemon=True)
    thread.start()
    try:
        for i, path in enumerate(ordered):
            if failed:
                break
            scan = native_pass.scan_file(path, i, native) if native else scan_file(path, i)
            scan.name = name(path)
            scans.append(scan)
            stats.lines += scan.n_valid
            if scan.fast:
                stats.fast_files += 1
                batch.append(scan)
                if native:
                    batch_bytes += native_pass.rows_of(scan)
                    if batch_bytes >= BATCH_ROWS:
                        jobs.put(("native", batch))
                        batch, batch_bytes = [], 0
                else:
                    batch_bytes += scan.text_bytes
                    if batch_bytes >= BATCH_BYTES or len(batch) >= BATCH_FILES:
                        jobs.put(("batch", batch))
                        batch, batch_bytes = [], 0
            else:
                stats.slow_files += 1
                jobs.put(("slow", scan))
            say(f"scanned {i + 1:,}/{len(ordered):,} files, {stats.lines:,} lines checked "
                f"({stats.slow_files:,} files for the reference reader)")
        if batch and not failed:
            jobs.put(("native" if native else "batch", batch))
    finally:
        jobs.put(None)
        thread.join()
    if failed:
        raise failed[0]
    return scans



