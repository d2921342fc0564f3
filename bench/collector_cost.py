"""What the probe's background threads cost per room, in CPU time that holds the GIL.

Why: on the H200 rig the decode loop's own work grew with the probe on by
more than the probe's calls on that loop take (docs/overhead.md). The
suspect is the probe's background threads taking the GIL from a serving
thread busy in Python: per decode room, the collector folds the cells,
judges, builds the room record and updates metrics, and the room-log
writer encodes and writes the line. This times each of those per room on
the calling thread, with the product's own objects (DigestEngine with the
NumPy reference backend, DecodeMonitor, RoomLogWriter, ProbeMetrics), so
the number can be set against the loop's growth per batch.

A room's life on the collector is timed stage by stage: its receipt
(`decode_recv`), one `decode_step` and its finish (`decode_finish`, which
retires it). `--diagnosis` adds what diagnosis costs there (docs/diagnosis.md):
the allocation snapshot's delivery (fold and content into the index), each
matching digest's content kept as the room's verified content, and the
retirement moving it to the freed table; the serving thread's journal calls
are counted by bench/hook_ops.py.

Timings on a shared 2-core machine swing by half between runs, so a few more rooms
(`--count-rooms`, before the timed ones) count instead the Python functions and C
calls of a room's life on the collector: deterministic, so two versions of the code
compare in one run each.

Usage:  python3 -m bench.collector_cost [--rooms 2000] [--layers 30] [--pages 17] [--diagnosis]
                                        [--count-rooms 20] [--profile FILE] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from bench.harness import CallCounter, PartTimer, median, median_us, write_result
from dsv4_idxk_probe.config import DiagnosisConfig
from dsv4_idxk_probe.diagnosis.tracker import decode_diagnosis
from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, get_layout
from dsv4_idxk_probe.metrics.definitions import ProbeMetrics
from dsv4_idxk_probe.pd import DecodeMonitor, InbandDigest, RoomId
from dsv4_idxk_probe.pd.decode import _Room
from dsv4_idxk_probe.roomlog import RoomLogWriter

STAGES = ("decode_recv", "decode_step", "decode_finish")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rooms", type=int, default=2000)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--pages", type=int, default=17)
    p.add_argument("--diagnosis", action="store_true", help="diagnosis on, with the shipped bounds")
    p.add_argument("--count-rooms", type=int, default=20, help="rooms whose collector calls are counted, not timed")
    p.add_argument("--profile", type=Path, help="write a cProfile of the timed collector work here")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    layout = get_layout("fp8")
    buffers = [torch.randint(0, 256, (args.pages + 1, layout.row_bytes), dtype=torch.uint8) for _ in range(args.layers)]
    engine = DigestEngine(layout, list(range(args.layers)), buffers, backend="reference")
    pages, tokens = np.arange(args.pages) + 1, args.pages * 256 - 100
    # decode's diagnosis as the probe builds it, with the shipped bounds (DiagnosisConfig's defaults)
    shipped = SimpleNamespace(diagnosis=DiagnosisConfig(enabled=args.diagnosis))
    diagnosis = decode_diagnosis(shipped, layout, engine.layer_ids)
    in_diagnosis = PartTimer(time.thread_time)  # thread CPU inside the diagnosis's collector calls, this room so far
    profiler = None
    if args.profile is not None:
        import cProfile
        profiler = cProfile.Profile()
    with tempfile.TemporaryDirectory() as logs:
        # The writer starts only once every record is queued, so its CPU per room is
        # measured alone, and it takes no GIL from the collector loop timed below.
        writer = RoomLogWriter(logs, "decode", queue_size=(args.count_rooms + args.rooms) * len(STAGES), start=False)
        monitor = DecodeMonitor(engine, writer.emit, ProbeMetrics(CollectorRegistry(), role="decode"),
                                diagnosis=diagnosis)
        # Cells computed once: the reference digest is not what a GPU collector pays. Every
        # stage of a room digests the same bytes, so one set of cells serves them all.
        request = lambda i: [RoomRequest(RoomId(i).key, pages, tokens)]  # noqa: E731
        n_rooms = args.count_rooms + args.rooms
        tickets = [[engine._launch(request(i), lambda _: None) for _ in range(len(STAGES) + 1)]
                   for i in range(n_rooms)]
        for room_tickets in tickets:
            room_tickets[-1].contents_only = True  # the allocation snapshot, as room_allocated submits it
        parts: dict[str, list[float]] = {"fold": [], "judge": [], "snapshot": [], "total": [], "diagnosis": []}
        parts.update({stage: [] for stage in STAGES})
        counts: list[tuple[int, int]] = []
        for i, room_tickets in enumerate(tickets):
            room = RoomId(i)
            if diagnosis is not None and i == args.count_rooms:  # timed from here on: counted rooms run bare
                for name in ("observe", "before", "retired"):
                    in_diagnosis.wrap(diagnosis, name, "diagnosis")
            if diagnosis is not None:
                diagnosis.allocated(room.key, pages)  # serving thread: not timed here (bench/hook_ops.py)
            room_cpu, in_diagnosis.totals["diagnosis"] = 0.0, 0.0
            counter = CallCounter() if i < args.count_rooms else None
            if counter is not None:
                sys.setprofile(counter)
            elif profiler is not None:
                profiler.enable()
            if diagnosis is not None:
                cpu_started = time.thread_time()
                monitor._on_before(room.key, pages, tokens, engine._finish(room_tickets[-1]))
                spent = time.thread_time() - cpu_started
                parts["snapshot"].append(spent)
                room_cpu += spent
                in_diagnosis.totals["diagnosis"] = spent  # all of the snapshot's delivery is diagnosis's
            state = None
            for stage, ticket in zip(STAGES, room_tickets):
                started, cpu_started = time.perf_counter(), time.thread_time()
                batch = engine._finish(ticket)
                folded = time.perf_counter()
                digest = batch.digests[0]
                if state is None:
                    # The monitor's state of a received room, made here: room_received would
                    # also submit a digest, and its delivery would write a second record.
                    state = _Room(room, pages, tokens, InbandDigest(digest.room, digest.signature, tokens))
                    with monitor._lock:
                        monitor._rooms[room.key] = state
                state.in_flight += 1
                state.finished = stage == "decode_finish"
                content = batch.contents[0] if diagnosis is not None else None
                enqueued_ns = time.monotonic_ns() if diagnosis is not None else None
                step = 64 if stage == "decode_step" else None
                monitor._on_result(state, stage, step, time.monotonic(), digest, batch.room_bytes[0], content,
                                   enqueued_ns)
                spent = time.thread_time() - cpu_started
                parts[stage].append(spent)
                room_cpu += spent
                if stage == "decode_recv":
                    parts["fold"].append(folded - started)
                    parts["judge"].append(time.perf_counter() - folded)
            if counter is not None:
                sys.setprofile(None)
                counts.append((counter.calls, counter.c_calls))
                if diagnosis is not None:
                    diagnosis.freed(room.key, pages)
                continue
            if profiler is not None:
                profiler.disable()
            parts["total"].append(room_cpu)
            if diagnosis is not None:
                parts["diagnosis"].append(in_diagnosis.totals["diagnosis"])
                diagnosis.freed(room.key, pages)  # serving thread, as above
        engine.close()
        writer_started = time.process_time()
        writer.start()
        writer.flush(timeout=60)
        writer_cpu = time.process_time() - writer_started
        written = writer.written
        writer.close()
    expected = n_rooms * len(STAGES)
    if written != expected:
        print(f"INVALID: the room log holds {written} of {expected} records", file=sys.stderr)
        return 1
    if monitor.tracked():
        print(f"INVALID: {monitor.tracked()} rooms still tracked after their finish", file=sys.stderr)
        return 1
    report = {
        "rooms": args.rooms, "layers": args.layers, "pages": args.pages, "python": sys.version.split()[0],
        "diagnosis": args.diagnosis,
        "fold_us": median_us(parts["fold"]), "judge_record_metrics_us": median_us(parts["judge"]),
        "collector_thread_cpu_us": median_us(parts["decode_recv"]),
        "stage_cpu_us": {stage: median_us(parts[stage]) for stage in STAGES},
        "snapshot_cpu_us": median_us(parts["snapshot"]) if parts["snapshot"] else None,
        "room_cpu_us": median_us(parts["total"]),
        # the snapshot's delivery plus the diagnosis's calls (observe, before, retired) in the stages
        "diagnosis_cpu_us": median_us(parts["diagnosis"]) if parts["diagnosis"] else None,
        "log_writer_cpu_us_per_record": 1e6 * writer_cpu / expected,
        # per room, the snapshot's delivery and every stage, on the first `count_rooms` rooms
        "python_calls_per_room": median(c for c, _ in counts) if counts else None,
        "c_calls_per_room": median(c for _, c in counts) if counts else None,
    }
    if diagnosis is not None:
        report["index_cells"] = diagnosis.index.cells
        report["journal_events"] = len(diagnosis.journal)
    print(f"per room ({args.layers} layers x {args.pages} pages, {args.rooms} rooms, medians, diagnosis "
          f"{'on' if args.diagnosis else 'off'}): receipt fold {report['fold_us']:.1f} us, "
          f"judge + record + metrics {report['judge_record_metrics_us']:.1f} us; collector thread CPU: "
          + ", ".join(f"{stage} {us:.1f} us" for stage, us in report["stage_cpu_us"].items())
          + (f", allocation snapshot {report['snapshot_cpu_us']:.1f} us" if report["snapshot_cpu_us"] is not None else "")
          + f"; the room's life {report['room_cpu_us']:.1f} us"
          + (f" (diagnosis's part {report['diagnosis_cpu_us']:.1f} us)" if report["diagnosis_cpu_us"] is not None else "")
          + (f"; counted: {report['python_calls_per_room']:.0f} Python functions, {report['c_calls_per_room']:.0f} C calls"
             if counts else "")
          + "; room-log writer "
          f"{report['log_writer_cpu_us_per_record']:.1f} us CPU per record (mean)")
    if args.out is not None:
        write_result(args.out, "collector_cost.json", report)
    if profiler is not None:
        profiler.dump_stats(str(args.profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
