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

Usage:  python3 bench/collector_cost.py [--rooms 2000] [--layers 30] [--pages 17] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry  # noqa: E402

from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, get_layout  # noqa: E402
from dsv4_idxk_probe.metrics.definitions import ProbeMetrics  # noqa: E402
from dsv4_idxk_probe.pd import DecodeMonitor, InbandDigest, RoomId  # noqa: E402
from dsv4_idxk_probe.pd.decode import _Room  # noqa: E402
from dsv4_idxk_probe.roomlog import RoomLogWriter  # noqa: E402


def _median_us(samples: list[float]) -> float:
    return 1e6 * statistics.median(samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rooms", type=int, default=2000)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--pages", type=int, default=17)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    layout = get_layout("fp8")
    buffers = [torch.randint(0, 256, (args.pages + 1, layout.row_bytes), dtype=torch.uint8) for _ in range(args.layers)]
    engine = DigestEngine(layout, list(range(args.layers)), buffers, backend="reference")
    pages, tokens = np.arange(args.pages) + 1, args.pages * 256 - 100
    with tempfile.TemporaryDirectory() as logs:
        # The writer starts only once every record is queued, so its CPU per room is
        # measured alone, and it takes no GIL from the collector loop timed below.
        writer = RoomLogWriter(logs, "decode", queue_size=args.rooms, start=False)
        monitor = DecodeMonitor(engine, writer.emit, ProbeMetrics(CollectorRegistry(), role="decode"))
        # Cells computed once: the reference digest is not what a GPU collector pays.
        tickets = [engine._launch([RoomRequest(RoomId(i).key, pages, tokens)], lambda _: None) for i in range(args.rooms)]
        fold, verdict, cpu = [], [], []
        for i, ticket in enumerate(tickets):
            room = RoomId(i)
            started, cpu_started = time.perf_counter(), time.thread_time()
            batch = engine._finish(ticket)
            folded = time.perf_counter()
            digest = batch.digests[0]
            # The monitor's state of a received room, made here: room_received would also
            # submit a digest, and its delivery would write a second record.
            state = _Room(room, pages, tokens, InbandDigest(digest.room, digest.signature, tokens), in_flight=1)
            monitor._on_result(state, "decode_recv", None, time.monotonic(), digest, batch.room_bytes[0])
            fold.append(folded - started)
            verdict.append(time.perf_counter() - folded)
            cpu.append(time.thread_time() - cpu_started)
        engine.close()
        writer_started = time.process_time()
        writer.start()
        writer.flush(timeout=60)
        writer_cpu = time.process_time() - writer_started
        written = writer.written
        writer.close()
    if written != args.rooms:
        print(f"INVALID: the room log holds {written} of {args.rooms} records", file=sys.stderr)
        return 1
    report = {
        "rooms": args.rooms, "layers": args.layers, "pages": args.pages, "python": sys.version.split()[0],
        "fold_us": _median_us(fold), "judge_record_metrics_us": _median_us(verdict),
        "collector_thread_cpu_us": _median_us(cpu),
        "log_writer_cpu_us_per_room": 1e6 * writer_cpu / args.rooms,
    }
    print(f"per room ({args.layers} layers x {args.pages} pages, {args.rooms} rooms, medians): fold {report['fold_us']:.1f} us, "
          f"judge + record + metrics {report['judge_record_metrics_us']:.1f} us, collector thread CPU "
          f"{report['collector_thread_cpu_us']:.1f} us; room-log writer "
          f"{report['log_writer_cpu_us_per_room']:.1f} us CPU per room (mean)")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "collector_cost.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
