"""Memory and disk the probe holds, measured: rooms in flight, log bytes, floods.

Why: "bounded memory and disk, with what was dropped counted" is an
invariant; this shows the numbers and that the configured bounds hold.
Each part runs in a fresh interpreter (this script, ``--part NAME``), so its
resident-memory baseline is not polluted by another part:

* ``inflight``: one process holding a PrefillMonitor and a DecodeMonitor
  (real DigestEngines, real RoomLogWriters, metrics) with --rooms rooms in
  flight: sent by prefill (kept in its exchange table) and received by
  decode, not finished. VmRSS (/proc/self/status) is read before and after,
  after a warm-up and gc; then every room finishes and it is read again.
  The table sizes are set to hold every room, and the run checks that both
  really hold all of them.
* ``logbytes``: real room-log lines from RoomLogWriter (gzip off) for rooms
  of 1, 16 and 64 pages at the fp8 layout: bytes per room per stage, a
  mismatching room's records, and the same logs gzip-compressed as rotation
  keeps them.
* ``flood``: --flood-rooms rooms pushed through PrefillMonitor and
  DecodeMonitor with the product's default table size (never finished on
  decode), while a client hammers prefill's exchange server (VectorServer)
  with lookups and malformed requests, and both room logs rotate under a
  small configured size. A sampler thread records the table sizes and the
  log folder sizes as the flood runs; RSS is read every --sample-every rooms.
  With --diagnosis (the probe's default; without it, verification alone) decode keeps its page
  journal and content index too, and their peak sizes are checked against
  their bounds.

What "flat" means in the flood: from twice the table size on, the memory the
process *holds* must not grow by more than --flat-tolerance-mib: C malloc's
in-use bytes (glibc mallinfo2, every arena), RSS after glibc gave its free
pages back (malloc_trim, taken at that point and at the end), and, with
--tracemalloc, Python's traced bytes. Raw RSS is reported, not bounded: it
also counts chunks the probe freed that glibc keeps for reuse in its arenas
(one per thread that allocates: collectors, room-log writers, the exchange
server and client), and those pages creep up in shrinking steps as the
arenas fragment. Measured (2026-12-01, 30,000 rooms, --tracemalloc): from
12,500 rooms on, raw RSS +2.4 MiB, malloc's free bytes +2.1 MiB, malloc
in use -0.01 MiB, traced Python memory +0.0 MiB (the top growth sites by
line: a few hundred KiB each way, the content index replacing its rooms).
A leak shows in the held figures; the creep does not.

Digest cost is not the subject here, so ``inflight`` and ``flood`` use a
layout with fp8's two segments (payload, scale) and 16 slots of 4 B each
(128 B rows): per-room state depends on layers, segments and pages, never
on row bytes (the digest folds every row into those vectors), and the
NumPy digests stay cheap on a small CPU. ``logbytes`` uses the real fp8
layout.

Usage:  python3 -m bench.memory_bounds --out DIR [--rooms 10000] [--flood-rooms 100000]
Prints a short table last; writes memory_bounds.json under --out. Exit
status 0 when every bound held and every check passed.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import gzip
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import defaultdict
from pathlib import Path

from bench.harness import REPO, command_line, module_command, write_json, write_result

PAGE_TOKENS = 256
MIB = 1 << 20


def rss_bytes() -> int:
    """Resident set size of this process, from the kernel's own accounting."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def settled_rss() -> int:
    gc.collect()
    return rss_bytes()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):  # not glibc (or older than 2.33): no allocator figures
        return None


_LIBC = _libc()


def heap_stats() -> dict:
    """What C malloc (glibc, every arena) has handed out and not had back, and what it holds
    free: in-use bytes are what the process keeps; free ones are reused by later
    allocations, but count in RSS wherever their pages were touched. Python's small
    objects live in obmalloc's own arenas, outside these; tracemalloc covers those."""
    out = {}
    if _LIBC is not None:
        m = _LIBC.mallinfo2()
        out = {"malloc_in_use_mib": (m.uordblks + m.hblkhd) / MIB, "malloc_free_mib": m.fordblks / MIB}
    if tracemalloc.is_tracing():
        out["traced_mib"] = tracemalloc.get_traced_memory()[0] / MIB
    return out


def held_memory() -> dict:
    """RSS as it is, then after glibc gave its free pages back (malloc_trim): what stays
    resident then is memory the process holds, plus pages only partly in use."""
    gc.collect()
    out = {"rss_mib": rss_bytes() / MIB, **heap_stats()}
    trimmed = None
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
        trimmed = rss_bytes() / MIB
    out["rss_after_trim_mib"] = trimmed
    return out


# %% one side of each kind, in one process


class Counting:
    """A room-log sink that counts what reached it before handing it to the writer."""

    def __init__(self, writer):
        self.writer = writer
        self.count = 0
        self.by_stage: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def __call__(self, record: dict) -> bool:
        with self._lock:
            self.count += 1
            self.by_stage[f"{record.get('stage')}:{record.get('verdict')}"] += 1
        return self.writer.emit(record)


class Pair:
    """PrefillMonitor + DecodeMonitor over one set of buffers, as the two pods would hold them."""

    def __init__(self, layout, layers: int, pool_pages: int, table_size: int, log_dir: Path, *,
                 max_bytes: int, max_files: int, gzip_rotated: bool, seed: int = 1, step_interval: int = 0,
                 separate_buffers: bool = False, diagnosis=None):
        import torch
        from prometheus_client import CollectorRegistry

        from dsv4_idxk_probe.digest import DigestEngine
        from dsv4_idxk_probe.metrics.definitions import ProbeMetrics
        from dsv4_idxk_probe.pd import DecodeMonitor, PrefillMonitor
        from dsv4_idxk_probe.roomlog import RoomLogWriter

        g = torch.Generator().manual_seed(seed)
        self.layout = layout
        ids = list(range(layers))
        self.pre_buffers = [torch.randint(0, 256, (pool_pages, layout.row_bytes), dtype=torch.uint8, generator=g)
                            for _ in ids]
        self.dec_buffers = [b.clone() for b in self.pre_buffers] if separate_buffers else self.pre_buffers
        self.metrics = {role: ProbeMetrics(CollectorRegistry(), role=role) for role in ("prefill", "decode")}
        self.writers = {role: RoomLogWriter(log_dir, role, max_bytes=max_bytes, max_files=max_files,
                                            gzip_rotated=gzip_rotated, metrics=self.metrics[role])
                        for role in ("prefill", "decode")}
        self.sinks = {role: Counting(w) for role, w in self.writers.items()}
        self.prefill = PrefillMonitor(DigestEngine(layout, ids, self.pre_buffers), self.sinks["prefill"],
                                      self.metrics["prefill"], table_size=table_size)
        # diagnosis (--diagnosis; None: verification alone): decode's own page journal and
        # content index, and a digest of each room's pages when they are allocated
        from dsv4_idxk_probe.config import DiagnosisConfig, ProbeConfig
        from dsv4_idxk_probe.diagnosis.tracker import decode_diagnosis

        self.diagnosis_config = diagnosis or DiagnosisConfig(enabled=False)
        self.diagnosis = decode_diagnosis(ProbeConfig(diagnosis=self.diagnosis_config), layout, ids)
        self.decode = DecodeMonitor(DigestEngine(layout, ids, self.dec_buffers), self.sinks["decode"],
                                    self.metrics["decode"], fetch_vectors=self.prefill.lookup,
                                    step_interval=step_interval, max_rooms=table_size, diagnosis=self.diagnosis,
                                    snapshot_on_allocation=self.diagnosis_config.snapshot_on_allocation)
        self.submitted = 0  # digests asked for (each ends in one record)

    def send_and_receive(self, room: int, pages, n_tokens: int) -> None:
        from dsv4_idxk_probe.pd import InbandDigest, RoomId

        rid = RoomId(room)
        self.decode.room_allocated(rid, pages, n_tokens)
        pending = self.prefill.room_sent(rid, pages, n_tokens)
        inband = None
        if pending is not None:
            while not pending.ready():
                time.sleep(0.0005)
            inband = InbandDigest(int(pending.room_digests[0]), self.prefill.engine.signature, n_tokens)
        self.decode.room_received(rid, pages.clone(), n_tokens, inband)
        self.submitted += 2

    def finish(self, room: int) -> None:
        from dsv4_idxk_probe.pd import RoomId

        self.decode.room_finished(RoomId(room))
        self.submitted += 1

    def diagnosis_sizes(self) -> dict:
        d = self.diagnosis
        if d is None:
            return {"journal_events": 0, "journal_bytes": 0, "index_cells": 0, "index_bytes": 0, "tracks": 0}
        return {"journal_events": len(d.journal), "journal_bytes": d.journal.nbytes(), "index_cells": d.index.cells,
                "index_bytes": d.index.nbytes(), "tracks": len(d._tracks)}

    def emitted(self) -> int:
        return sum(s.count for s in self.sinks.values())

    def drain(self, lag: int = 0, timeout: float = 120.0) -> None:
        """Wait until at most `lag` digests are still on their way to the room log."""
        deadline = time.monotonic() + timeout
        while self.submitted - self._records_for_submitted() > lag and time.monotonic() < deadline:
            time.sleep(0.002)

    def _records_for_submitted(self) -> int:
        evicted = sum(n for k, n in self.sinks["decode"].by_stage.items() if k.endswith(":skipped"))
        return self.emitted() - evicted

    def close(self) -> dict:
        for monitor in (self.prefill, self.decode):
            monitor.engine.close()
        for w in self.writers.values():
            w.close()
        return {
            "digest_batches_dropped": self.prefill.engine.stats.dropped_batches + self.decode.engine.stats.dropped_batches,
            "log_records_written": {r: w.written for r, w in self.writers.items()},
            "log_records_dropped": {r: w.dropped for r, w in self.writers.items()},
        }


def diagnosis_config(args, **overrides):
    from dsv4_idxk_probe.config import DiagnosisConfig

    return DiagnosisConfig(enabled=args.diagnosis, **overrides)


def small_layout():
    from dsv4_idxk_probe.digest.layout import RowLayout, Segment

    slots = 16
    return RowLayout("fp8-segments-128B", slots, PAGE_TOKENS // slots,
                     (Segment("payload", 0, 4), Segment("scale", slots * 4, 4)), slots * 8)


def room_pages(rng, pool_pages: int, pages: int):
    import torch

    return torch.from_numpy(rng.choice(pool_pages - 1, size=pages, replace=False).astype("int64") + 1)


# %% parts


def part_inflight(args, work: Path) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    n_tokens = args.pages * PAGE_TOKENS - 100  # a partial last page, as most rooms have
    warm = 200
    pair = Pair(small_layout(), args.layers, args.pool_pages, args.rooms + warm, work / "logs",
                max_bytes=64 * MIB, max_files=8, gzip_rotated=True, step_interval=64, diagnosis=diagnosis_config(args))
    for i in range(warm):  # warm-up: one-time allocations (threads, caches, metric children)
        pair.send_and_receive(i + 1, room_pages(rng, args.pool_pages, args.pages), n_tokens)
    pair.drain()
    from dsv4_idxk_probe.pd import RoomId

    for i in range(warm):
        pair.decode.room_finished(RoomId(i + 1))
    pair.submitted += warm
    pair.drain()
    base = settled_rss()
    started = time.monotonic()
    for i in range(args.rooms):
        pair.send_and_receive(10_000_000 + i, room_pages(rng, args.pool_pages, args.pages), n_tokens)
        if i % 256 == 255:
            pair.drain(lag=512)
    pair.drain()
    for w in pair.writers.values():
        w.flush(60)
    seconds = time.monotonic() - started
    tracked, held = pair.decode.tracked(), len(pair.prefill.recent)
    inflight = settled_rss()
    for i in range(args.rooms):
        pair.decode.room_finished(RoomId(10_000_000 + i))
    pair.submitted += args.rooms
    pair.drain()
    finished = settled_rss()
    tracked_after = pair.decode.tracked()
    closed = pair.close()
    ok = tracked == args.rooms and held == args.rooms + warm and tracked_after == 0
    return {
        "rooms": args.rooms, "layers": args.layers, "pages_per_room": args.pages, "table_size": args.rooms + warm,
        "rss_base_mib": base / MIB, "rss_inflight_mib": inflight / MIB, "rss_after_finish_mib": finished / MIB,
        "delta_mib": (inflight - base) / MIB, "bytes_per_room": (inflight - base) / args.rooms,
        "decode_tracked": tracked, "prefill_table": held, "decode_tracked_after_finish": tracked_after,
        "seconds": seconds, **closed,
        "ok": ok and closed["digest_batches_dropped"] == 0,
    }


def part_logbytes(args, work: Path) -> dict:
    import numpy as np

    from dsv4_idxk_probe.digest import get_layout
    from dsv4_idxk_probe.pd import RoomId

    layout = get_layout("fp8")
    out = {}
    for pages in args.log_pages:
        rng = np.random.default_rng(pages)
        log_dir = work / f"logs-{pages}"
        pool = pages * 2 + 2
        pair = Pair(layout, args.layers, pool, 4096, log_dir, max_bytes=1 << 30, max_files=2, gzip_rotated=False,
                    step_interval=args.step_interval, separate_buffers=True, diagnosis=diagnosis_config(args))
        n_tokens = pages * PAGE_TOKENS - 100 if pages > 1 else 200
        for k in range(args.log_rooms):
            room = pages * 1000 + k
            p = room_pages(rng, pool, pages)
            mismatch = k < args.log_mismatch_rooms
            if mismatch:  # a byte changed on decode before receipt: mismatch at every stage, localised
                pair.dec_buffers[k % args.layers][int(p[0]), 7] ^= 0x40
            pair.send_and_receive(room, p, n_tokens)
            for step in range(1, args.log_steps + 1):  # alone in its batches: batch number = step
                if pair.decode.step_due(step) and pair.decode.batch_done([], [(RoomId(room), step)]) is not None:
                    pair.submitted += 1
            pair.decode.room_finished(RoomId(room))
            pair.submitted += 1
            pair.drain()
            if mismatch:
                pair.dec_buffers[k % args.layers][int(p[0]), 7] ^= 0x40
        closed = pair.close()
        out[str(pages)] = {**measure_log_lines(log_dir, args.log_rooms, args.log_mismatch_rooms), **closed}
    return {"layout": "fp8", "row_bytes": layout.row_bytes, "layers": args.layers, "rooms": args.log_rooms,
            "mismatch_rooms": args.log_mismatch_rooms, "decode_steps": args.log_steps,
            "step_interval": args.step_interval, "by_pages": out,
            "ok": all(v["log_records_dropped"] == {"prefill": 0, "decode": 0} for v in out.values())}


def measure_log_lines(log_dir: Path, rooms: int, mismatch_rooms: int) -> dict:
    """Bytes of real lines, grouped by stage and verdict; plus gzip of the whole files."""
    per: dict[str, list[int]] = defaultdict(list)
    raw = 0
    packed = 0
    for path in sorted(log_dir.glob("*.jsonl")):
        data = path.read_bytes()
        raw += len(data)
        packed += len(gzip.compress(data, compresslevel=6))  # what rotation keeps (level 6, as the writer)
        for line in data.splitlines(keepends=True):
            record = json.loads(line)
            verdict = record.get("verdict") or "-"
            kind = "mismatch" if verdict == "mismatch" else "clean"
            per[f"{record['stage']}:{kind}"].append(len(line))
    stages = {k: {"records": len(v), "bytes_per_record": sum(v) / len(v), "max_bytes": max(v)} for k, v in sorted(per.items())}
    return {"stages": stages, "bytes_per_room": raw / rooms, "gzip_bytes_per_room": packed / rooms,
            "clean_rooms": rooms - mismatch_rooms}


def part_flood(args, work: Path) -> dict:
    import numpy as np

    from dsv4_idxk_probe.config import ExchangeConfig

    defaults = ExchangeConfig()
    table = defaults.table_size
    rng = np.random.default_rng(1)
    log_dir = work / "logs"
    diagnosis = diagnosis_config(args, index_cells=args.flood_index_cells)
    pair = Pair(small_layout(), args.flood_layers, 64, table, log_dir, max_bytes=args.flood_log_bytes,
                max_files=args.flood_log_files, gzip_rotated=True, step_interval=0, diagnosis=diagnosis)
    most = {"journal_events": 0, "journal_bytes": 0, "index_cells": 0, "index_bytes": 0, "tracks": 0}
    exchange = ExchangeLoad(pair.prefill.lookup, defaults.max_request_bytes)
    sampler = Sampler(pair, log_dir)
    samples = []
    n_tokens = args.flood_pages * PAGE_TOKENS - 100 if args.flood_pages > 1 else 200
    for i in range(200):  # warm-up, as in inflight
        pair.send_and_receive(i + 1, room_pages(rng, 64, args.flood_pages), n_tokens)
    pair.drain()
    exchange.start()
    sampler.start()
    full_snapshot = held_at_full = None
    base = settled_rss()
    started = time.monotonic()
    for i in range(args.flood_rooms):
        room = 1_000_000 + i
        pair.send_and_receive(room, room_pages(rng, 64, args.flood_pages), n_tokens)
        exchange.latest = room
        if args.flood_finish_every and i % args.flood_finish_every == 0:
            pair.finish(room)  # its pages freed: its content stays in the index as their last occupant's
        if i % 256 == 255:
            pair.drain(lag=512)  # a room costs decode up to three batches (snapshot, receipt, finish)
        if (i + 1) % args.sample_every == 0:
            sizes = pair.diagnosis_sizes()
            most = {k: max(v, sizes[k]) for k, v in most.items()}
            samples.append({"rooms": i + 1, "rss_mib": rss_bytes() / MIB, "table": len(pair.prefill.recent),
                            "tracked": pair.decode.tracked(), **sizes, **heap_stats()})
            if held_at_full is None and i + 1 >= 2 * table:  # the table is full: from here on, flat
                held_at_full = held_memory()
                if tracemalloc.is_tracing():
                    full_snapshot = tracemalloc.take_snapshot()
    pair.drain()
    seconds = time.monotonic() - started
    exchange.stop()
    sampler.stop()
    heap = {"at_table_full": held_at_full, "at_end": held_memory()}
    if full_snapshot is not None:  # where traced Python memory grew after the table was full
        heap["traced_growth_top"] = [
            {"where": str(stat.traceback[0]), "size_diff_kib": stat.size_diff / 1024, "count_diff": stat.count_diff}
            for stat in tracemalloc.take_snapshot().compare_to(full_snapshot, "lineno")[:12]]
    closed = pair.close()
    sampler.sample()  # after the writers closed: the files that stay
    end = settled_rss()
    full = next((s for s in samples if s["rooms"] >= 2 * table), samples[0])
    growth = samples[-1]["rss_mib"] - full["rss_mib"]
    start = held_at_full or heap["at_end"]  # (a flood shorter than twice the table: nothing to compare)
    held = {k: heap["at_end"][k] - start[k] for k in heap["at_end"] if k != "malloc_free_mib" and start[k] is not None}
    line_max = sampler.max_line
    disk_bound = args.flood_log_files * args.flood_log_bytes + line_max
    checks = {
        "table_never_over_size": sampler.max_table <= table,
        "decode_tracked_never_over_max_rooms": sampler.max_tracked <= table,
        "log_disk_within_bound_per_writer": all(v <= disk_bound for v in sampler.max_disk.values()),
        "log_files_within_max_files": all(v <= args.flood_log_files for v in sampler.max_files.values()),
        # what the process holds, not what glibc keeps free for reuse (module docstring)
        "held_memory_flat_after_table_full": all(v <= args.flat_tolerance_mib for k, v in held.items()
                                                 if k != "rss_mib"),
        "exchange_answered": exchange.found > 0 and exchange.errors == 0,
        "no_digest_batch_dropped": closed["digest_batches_dropped"] == 0,
        "journal_within_capacity": most["journal_events"] <= diagnosis.journal_events,
        "index_within_cell_bound": most["index_cells"] <= diagnosis.index_cells,
        # diagnosis tracks a room from its allocation (the snapshot digest), decode's table from
        # its receipt: the bound is the table plus the rooms in transfer, one at a time here
        "diagnosis_tracks_within_tracked_rooms": most["tracks"] <= table + 1,
    }
    return {
        "rooms": args.flood_rooms, "layers": args.flood_layers, "pages_per_room": args.flood_pages,
        "table_size": table, "max_table_seen": sampler.max_table, "max_tracked_seen": sampler.max_tracked,
        "evicted_from_table": pair.prefill.recent.evicted,
        "decode_evicted_as_skipped": pair.sinks["decode"].by_stage.get("decode_step:skipped", 0),
        "rss_base_mib": base / MIB, "rss_end_mib": end / MIB, "rss_samples": samples, "heap_at_end": heap,
        "rss_growth_after_table_full_mib": growth, "flat_tolerance_mib": args.flat_tolerance_mib,
        "held_growth_after_table_full_mib": held,
        "log": {"max_bytes": args.flood_log_bytes, "max_files": args.flood_log_files, "bound_bytes": disk_bound,
                "max_disk_seen": sampler.max_disk, "max_files_seen": sampler.max_files, "final_disk": sampler.last_disk},
        "exchange": {"lookups": exchange.lookups, "found": exchange.found, "not_found": exchange.not_found,
                     "bad_requests": exchange.bad, "bad_refused": exchange.server_refused(),
                     "errors": exchange.errors, "error_kinds": exchange.error_kinds},
        "diagnosis": {"journal_capacity": diagnosis.journal_events, "index_cells_bound": diagnosis.index_cells,
                      "finish_every": args.flood_finish_every, "max_seen": most,
                      "journal_bytes_per_event": most["journal_bytes"] / max(most["journal_events"], 1),
                      "index_bytes_per_cell": most["index_bytes"] / max(most["index_cells"], 1)},
        "sampler_samples": sampler.count, "seconds": seconds, **closed, "checks": checks, "ok": all(checks.values()),
    }


class ExchangeLoad:
    """Prefill's real VectorServer, asked for recent and long-evicted rooms while the flood runs,
    with a malformed request every so often (refused, and serving goes on)."""

    def __init__(self, lookup, max_request_bytes: int):
        self.lookup, self.max_request_bytes = lookup, max_request_bytes
        self.latest = 0
        self.lookups = self.found = self.not_found = self.bad = self.errors = 0
        self.error_kinds: dict[str, int] = {}  # what each error was (a malformed request not answered, a timeout...)
        self._stop = threading.Event()
        self.server = None

    def start(self) -> None:
        from dsv4_idxk_probe.exchange import VectorServer

        self.server = VectorServer(self.lookup, bind="127.0.0.1", port=0, max_request_bytes=self.max_request_bytes)
        self.server.start()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from dsv4_idxk_probe.exchange import VectorClient
        from dsv4_idxk_probe.exchange.client import raw_request

        client = VectorClient(timeout_ms=2000, backoff_s=0.1)
        n = 0
        while not self._stop.is_set():
            n += 1
            latest = self.latest
            if not latest:
                time.sleep(0.001)
                continue
            room = latest - (n % 3) * 50_000 if n % 3 else latest - 10  # recent, or long evicted
            digest = client.fetch(self.server.endpoint, f"{room}/0")
            self.lookups += 1
            if digest is not None:
                self.found += 1
            else:
                self.not_found += 1
            if n % 50 == 0:  # malformed: refused with an error answer
                self.bad += 1
                if raw_request(self.server.endpoint, b'{"v": 1, "id": "x", "key": 5}') is None:
                    self._error("malformed_not_answered")
            for kind in ("timeout", "transport", "protocol", "internal"):
                if client.failures.pop(kind, 0):
                    self._error(kind)
        client.close()

    def _error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    def server_refused(self) -> int:
        return self.server.refused if self.server is not None else 0

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(10)
        self.server.close()


class Sampler:
    """Table sizes and each writer's files on disk, sampled while the flood runs."""

    def __init__(self, pair: Pair, log_dir: Path, period: float = 0.01):
        self.pair, self.log_dir, self.period = pair, log_dir, period
        self.max_table = self.max_tracked = self.count = self.max_line = 0
        self.max_disk: dict[str, int] = defaultdict(int)
        self.max_files: dict[str, int] = defaultdict(int)
        self.last_disk: dict[str, int] = {}
        self._stop = threading.Event()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.period)

    def sample(self) -> None:
        self.count += 1
        self.max_table = max(self.max_table, len(self.pair.prefill.recent))
        self.max_tracked = max(self.max_tracked, self.pair.decode.tracked())
        for role, writer in self.pair.writers.items():
            total = files = 0
            for path in self.log_dir.glob(f"{writer.stem}.*"):  # temp .gz files of a rotation included
                try:
                    total += path.stat().st_size
                    files += not path.name.startswith(".")
                except FileNotFoundError:
                    continue
            self.last_disk[role] = total
            self.max_disk[role] = max(self.max_disk[role], total)
            self.max_files[role] = max(self.max_files[role], files)
        hidden = list(self.log_dir.glob(".*"))  # gzip temp files of a rotation in progress
        for path in hidden:
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            for role, writer in self.pair.writers.items():
                if writer.stem in path.name:
                    self.max_disk[role] = max(self.max_disk[role], self.last_disk[role] + size)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)
        for writer in self.pair.writers.values():  # the longest line decides the "+ one line" slack
            for path in writer.files:
                if path.suffix == ".jsonl":
                    with open(path, "rb") as f:
                        self.max_line = max([self.max_line, *(len(line) for line in f)])


PARTS = {"inflight": part_inflight, "logbytes": part_logbytes, "flood": part_flood}


# %% driver


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--parts", default="inflight,logbytes,flood")
    p.add_argument("--part", help=argparse.SUPPRESS)  # run one part in this process (the driver does this)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--rooms", type=int, default=10_000, help="rooms in flight")
    p.add_argument("--layers", type=int, default=30, help="C4 layers (DeepSeek-V4)")
    p.add_argument("--pages", type=int, default=16, help="pages per room in flight (4096 tokens)")
    p.add_argument("--pool-pages", type=int, default=256)
    p.add_argument("--log-pages", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    p.add_argument("--log-rooms", type=int, default=20)
    p.add_argument("--log-mismatch-rooms", type=int, default=2)
    p.add_argument("--log-steps", type=int, default=16, help="decode steps per room (logbytes)")
    p.add_argument("--step-interval", type=int, default=8)
    p.add_argument("--flood-rooms", type=int, default=100_000)
    p.add_argument("--flood-layers", type=int, default=1)
    p.add_argument("--flood-pages", type=int, default=1)
    p.add_argument("--flood-log-bytes", type=int, default=1 * MIB)
    p.add_argument("--flood-log-files", type=int, default=4)
    p.add_argument("--sample-every", type=int, default=5000)
    p.add_argument("--flood-finish-every", type=int, default=2,
                   help="finish every Nth flood room (0: none), so freed rooms fill the diagnosis index")
    p.add_argument("--flood-index-cells", type=int, default=20_000,
                   help="diagnosis.index_cells for the flood: small, so the bound is reached and held")
    p.add_argument("--diagnosis", action="store_true",
                   help="diagnosis on (the probe's default; without this flag, verification alone): "
                        "its journal, index and snapshots are measured too")
    p.add_argument("--tracemalloc", action="store_true",
                   help="trace Python allocations in the flood (slower): traced memory per sample, top growth at the end")
    p.add_argument("--flat-tolerance-mib", type=float, default=8.0,
                   help="RSS growth allowed from twice the table size to the end of the flood")
    return p.parse_args(argv)


def run_part(name: str, argv: list[str]) -> dict:
    """One part in a fresh interpreter, so its RSS baseline is its own."""
    with tempfile.TemporaryDirectory(prefix="idxk-mem-") as tmp:
        target = Path(tmp) / "part.json"
        cmd = module_command("memory_bounds", *argv, "--part", name, "--json", str(target))
        proc = subprocess.run(cmd, text=True, capture_output=True, cwd=REPO)
        if proc.returncode != 0 or not target.exists():
            return {"ok": False, "error": (proc.stderr or proc.stdout)[-3000:]}
        return json.loads(target.read_text())


def print_tables(report: dict) -> None:
    inf = report.get("inflight")
    if inf and "rss_base_mib" in inf:
        print(f"\nin flight: {inf['rooms']} rooms x {inf['layers']} layers x {inf['pages_per_room']} pages: RSS "
              f"{inf['rss_base_mib']:.1f} -> {inf['rss_inflight_mib']:.1f} MiB (+{inf['delta_mib']:.1f} MiB, "
              f"{inf['bytes_per_room']:.0f} B/room; decode tracked {inf['decode_tracked']}, prefill table "
              f"{inf['prefill_table']}); after every room finished {inf['rss_after_finish_mib']:.1f} MiB")
    logs = report.get("logbytes")
    if logs and "by_pages" in logs:
        print(f"\nroom-log bytes per record (fp8, {logs['layers']} layers, step_interval {logs['step_interval']}, "
              f"{logs['decode_steps']} steps/room)")
        stages = sorted({s for v in logs["by_pages"].values() for s in v["stages"]})
        print(f"{'pages':>5} " + " ".join(f"{s:>22}" for s in stages) + f" {'B/room':>8} {'gz B/room':>9}")
        for pages, v in logs["by_pages"].items():
            cells = [f"{v['stages'][s]['bytes_per_record']:22.0f}" if s in v["stages"] else f"{'-':>22}" for s in stages]
            print(f"{pages:>5} " + " ".join(cells) + f" {v['bytes_per_room']:8.0f} {v['gzip_bytes_per_room']:9.0f}")
    fl = report.get("flood")
    if fl and "checks" in fl:
        print(f"\nflood: {fl['rooms']} rooms, table size {fl['table_size']}: max table {fl['max_table_seen']}, max decode "
              f"tracked {fl['max_tracked_seen']}; RSS {fl['rss_base_mib']:.1f} -> {fl['rss_end_mib']:.1f} MiB, growth after "
              f"table full {fl['rss_growth_after_table_full_mib']:+.1f} MiB; log disk max {dict(fl['log']['max_disk_seen'])} "
              f"(bound {fl['log']['bound_bytes']} B per writer); exchange {fl['exchange']}")
        held = fl.get("held_growth_after_table_full_mib")
        if held:
            at = fl["heap_at_end"]
            print("  held after table full: " + ", ".join(f"{k} {v:+.2f}" for k, v in held.items())
                  + f" MiB (bound {fl['flat_tolerance_mib']} MiB each, rss_mib reported only); malloc free at end "
                  f"{at['at_end'].get('malloc_free_mib', float('nan')):.1f} MiB")
        dg = fl.get("diagnosis")
        if dg:
            seen = dg["max_seen"]
            print(f"  diagnosis: journal max {seen['journal_events']} events (capacity {dg['journal_capacity']}), "
                  f"{seen['journal_bytes'] / MIB:.2f} MiB ({dg['journal_bytes_per_event']:.0f} B/event); index max "
                  f"{seen['index_cells']} cells (bound {dg['index_cells_bound']}), {seen['index_bytes'] / MIB:.2f} MiB "
                  f"({dg['index_bytes_per_cell']:.0f} B/cell incl. per-room overhead); tracks max {seen['tracks']}")
        for name, ok in fl["checks"].items():
            print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    for name, part in report.items():
        if isinstance(part, dict) and part.get("error"):
            print(f"\n{name} FAILED:\n{part['error']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part:  # inside the child
        import torch

        torch.set_num_threads(1)
        if args.tracemalloc and args.part == "flood":
            tracemalloc.start(1)
        with tempfile.TemporaryDirectory(prefix="idxk-mem-") as tmp:
            result = PARTS[args.part](args, Path(tmp))
        write_json(args.json, result, default=float)
        return 0
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    passthrough = _without(passthrough, "--out", "--parts")
    report = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
              "cpus": os.cpu_count(), "command": command_line("memory_bounds", argv)}
    for name in args.parts.split(","):
        print(f"== {name}", flush=True)
        started = time.monotonic()
        report[name] = run_part(name, passthrough)
        report[name]["wall_seconds"] = round(time.monotonic() - started, 1)
    if args.out is not None:
        write_result(args.out, "memory_bounds.json", report, default=float)
    print_tables(report)
    ok = all(report[n].get("ok") for n in args.parts.split(","))
    print("RESULT:", "every bound held" if ok else "FAIL")
    return 0 if ok else 1


def _without(argv: list[str], *names: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if any(a.startswith(n + "=") for n in names):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
