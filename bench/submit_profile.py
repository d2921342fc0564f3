"""Where the caller's time goes in one `DigestEngine.submit`, part by part.

Why: on a host where every CUDA driver call is expensive (a sandboxed
runtime intercepts each one), the fixed cost of a submit decides the probe's
overhead per room. This times the device touch points of one submit on the
caller's thread (the device and current-stream look-ups, the kernel's C launch
function, the event record; the copies up and down are written inline in the
submit since 2026-12-03 and count in "the rest", with the room table, the
staging buffer and the hand-off) for single-room batches (`submit_room`, as
the hooks submit one room) and for 16-room batches, after a warm-up, with
sync debug mode "error" on, and prints medians. `--outputs pinned`: the
engine without copies (digest.outputs); `--download collector`: the copy down
left to the collector (decode's engine), so runs on one machine compare them.

Then times one-room submits after gaps of `--gap-ms` (default 10 ms, the rig's
model step) passed in different ways (`gap_study`).

Usage (CUDA):  python3 -m bench.submit_profile [--out DIR] [--layers 30] [--pages 17] [--calls 300]
                   [--gap-ms 10] [--gap-calls 200] [--outputs device|pinned] [--dependent-launch auto|off]
                   [--download submit|collector]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.harness import PartTimer, median_us, write_result
from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, get_layout
from dsv4_idxk_probe.digest import engine as engine_module
from dsv4_idxk_probe.testbed.builtin.modeltime import GpuForward, spin


def _launching(seconds: float) -> None:
    """Wait while the thread keeps driving the GPU: a tiny kernel every 0.5 ms."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.cuda._sleep(1000)
        time.sleep(0.0005)


def gap_study(engine: DigestEngine, args) -> dict:
    """One-room submits, each after a gap: a sleep, a spin, a spin that keeps
    launching small kernels, and a GPU kernel waited for on an event.

    Why: in the rig each submit follows a 10 ms sleep standing in for the
    model, and costs 3x what it costs back to back. This tells apart a cold
    core (sleep vs spin), a quiet driver (spin vs launching) and an idle GPU
    (the last: a scheduler thread waits for its forward this way).
    """
    torch.cuda.set_sync_debug_mode(0)  # the GPU-forward gap waits on an event on purpose
    forward = GpuForward(torch.device("cuda"))
    seconds = args.gap_ms / 1e3
    pages = np.arange(args.pages) + 1
    gaps = {"0.5 ms sleep (as above)": lambda: time.sleep(0.0005),
            f"{args.gap_ms:g} ms sleep": lambda: time.sleep(seconds),
            f"{args.gap_ms:g} ms spin (GIL released)": lambda: spin(seconds),
            f"{args.gap_ms:g} ms spin, a tiny kernel every 0.5 ms": lambda: _launching(seconds),
            f"{args.gap_ms:g} ms GPU kernel, waited on an event": lambda: forward(seconds)}
    results = {}
    for name, gap in gaps.items():
        walls = []
        for i in range(args.gap_calls):
            gap()
            started = time.perf_counter()
            engine.submit_room(f"g{i}", pages, args.pages * 256 - 100, lambda _: None)
            walls.append(time.perf_counter() - started)
        walls.sort()
        results[name] = {"median_us": median_us(walls), "p90_us": 1e6 * walls[int(0.9 * len(walls))]}
    return results


def host_ops(engine: DigestEngine, args) -> dict:
    """What each host-side operation of a submit costs on this machine, one at a time,
    back to back and right after a 10 ms sleep: the stream and device queries, writing
    a page table into pinned and into pageable memory, reading a room's cells back
    from each (the collector's fold), a queue hand-off.

    Why: on the H200 host a one-room submit spends ~125 us outside its launch, where
    the same Python takes ~5 us on a laptop-class CPU; this says which part is slow
    there (a driver query, pinned memory, or Python after a gap).
    """
    import queue

    pinned = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True).numpy().view(np.int64)
    pageable = np.zeros(1 << 13, dtype=np.int64)
    pages = list(range(1, args.pages + 1))
    cells = args.layers * args.pages * 2
    hand_off = queue.Queue(maxsize=1024)
    device = torch.cuda.current_device()
    ops = {
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "torch.cuda.current_device()": torch.cuda.current_device,
        "raw current stream (Triton's getter)": lambda: torch._C._cuda_getCurrentRawStream(device),
        f"write a {args.pages}-page table into pinned memory": lambda: pinned.__setitem__(slice(8, 8 + len(pages)), pages),
        f"write a {args.pages}-page table into pageable memory": lambda: pageable.__setitem__(slice(8, 8 + len(pages)), pages),
        f"sum {cells} cells read from pinned memory": lambda: pinned[:cells].view(np.uint64).sum(dtype=np.uint64),
        f"sum {cells} cells read from pageable memory": lambda: pageable[:cells].view(np.uint64).sum(dtype=np.uint64),
        "queue put + get": lambda: (hand_off.put_nowait(1), hand_off.get_nowait()),
    }
    kernel = engine._kernel
    if kernel.compiled.get(False) is not None:  # a launch of one empty room: every program returns at once
        from dsv4_idxk_probe.digest.kernel import current_stream

        empty = torch.zeros(64, dtype=torch.int64, pin_memory=True).data_ptr()
        grid = (1, kernel.n_layers, 1)
        launch_args = kernel.launch_args(empty, empty, empty, empty)

        def engine_launch():
            device, stream = current_stream()
            kernel.launch(empty, empty, empty, empty, 1, 1, device=device, stream=stream)

        ops["Triton launch, CompiledKernel[grid](...)"] = lambda: kernel.compiled[False][grid](*launch_args)
        ops["Triton launch, the engine's (C launcher, device and stream looked up)"] = engine_launch
    results = {}
    for name, op in ops.items():
        for _ in range(50):
            op()
        hot, cold = [], []
        for _ in range(args.gap_calls):
            started = time.perf_counter()
            op()
            hot.append(time.perf_counter() - started)
        for _ in range(min(args.gap_calls, 100)):
            time.sleep(args.gap_ms / 1e3)
            started = time.perf_counter()
            op()
            cold.append(time.perf_counter() - started)
        results[name] = {"back_to_back_us": median_us(hot), "after_gap_us": median_us(cold)}
    return results


def allocation_study(engine: DigestEngine, args) -> dict:
    """Decode's allocation hook with diagnosis on (`DecodeMonitor.room_allocated`: the
    snapshot's one-room submit; its journal event and the page ids' copy down are the
    collector's since 2026-12-03; without a snapshot the hook still copies them, with an
    event of its own), whole and by part, one call after each `--gap-ms` sleep as in the
    rig's decode loop.

    Why: in the serving legs this hook is what diagnosis adds to the serving thread
    (273-416 us median per call on the H200 host, 2026-12-02)."""
    from dsv4_idxk_probe.diagnosis import ContentIndex, PageJournal
    from dsv4_idxk_probe.diagnosis.host_ids import capture
    from dsv4_idxk_probe.diagnosis.tracker import DecodeDiagnosis
    from dsv4_idxk_probe.pd import DecodeMonitor, RoomId

    torch.cuda.set_sync_debug_mode(0)
    diagnosis = DecodeDiagnosis(engine.layout, engine.layer_ids, PageJournal(capacity=4096), ContentIndex(100_000))
    monitor = DecodeMonitor(engine, lambda *_: None, diagnosis=diagnosis, snapshot_on_allocation=True)
    tables = [torch.as_tensor(np.arange(args.pages) + (i % 64) * args.pages + 1, device="cuda")
              for i in range(args.gap_calls)]
    tokens = args.pages * 256 - 100
    ops = {
        "room_allocated (snapshot; page ids copied by the collector)":
            lambda i: monitor.room_allocated(RoomId(i), tables[i], tokens),
        "room_allocated, no snapshot (copy, own event)": lambda i: monitor.room_allocated(RoomId(10**6 + i), tables[i], tokens,
                                                                                          snapshot=False),
        "page ids copy down with its own event (capture)": lambda i: capture(tables[i]),
        "page ids copy down, event left to the caller": lambda i: capture(tables[i], deferred=True),
        "snapshot submit alone (one room, contents only)": lambda i: engine.submit_room(
            f"s{i}", tables[i], tokens, lambda _: None, contents_only=True),
    }
    results = {}
    for name, op in ops.items():
        for i in range(20):
            op(i)
        torch.cuda.synchronize()
        walls = []
        for i in range(args.gap_calls):
            time.sleep(args.gap_ms / 1e3)
            started = time.perf_counter()
            op(i)
            walls.append(time.perf_counter() - started)
        walls.sort()
        results[name] = {"median_us": median_us(walls), "p90_us": 1e6 * walls[int(0.9 * len(walls))]}
        torch.cuda.synchronize()
        time.sleep(0.05)  # the collector catches up between ops
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--pages", type=int, default=17)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--gap-ms", type=float, default=10.0, help="gap before each submit of the gap study")
    p.add_argument("--gap-calls", type=int, default=200)
    p.add_argument("--outputs", choices=engine_module.OUTPUTS, default="device", help="the engine's digest.outputs")
    p.add_argument("--dependent-launch", choices=engine_module.DEPENDENT_LAUNCHES, default="auto",
                   help="the engine's digest.dependent_launch")
    p.add_argument("--download", choices=engine_module.DOWNLOADS, default="submit",
                   help="who copies the outputs down (decode's engine: collector)")
    p.add_argument("--room-tables", choices=("in-place", "copied"), default="in-place",
                   help="where a several-room launch's kernel reads its room table: the pinned buffer in place "
                        "(the default) or its device twin, copied up first (mapped_tables=False)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    layout = get_layout("fp8")
    pool_pages = 64 * args.pages + 1
    buffers = [torch.randint(0, 256, (pool_pages, layout.row_bytes), dtype=torch.uint8, device="cuda")
               for _ in range(args.layers)]
    engine = DigestEngine(layout, list(range(args.layers)), buffers, outputs=args.outputs,
                          dependent_launch=args.dependent_launch, download=args.download,
                          mapped_tables=args.room_tables == "in-place")
    timer = PartTimer()
    direct = [d is not None for d in engine._direct]  # learnt at the engine's warm-up (launch.DirectLaunch)
    for d in engine._direct:
        if d is not None:
            d.fn = timer.timed(d.fn, "kernel launch (the C launch function, direct)")
    timer.wrap(engine._kernel, "launch", "kernel launch (DigestKernel.launch: not direct)")
    timer.wrap(engine, "_raw_stream", "current stream look-up (raw)")
    timer.wrap(engine, "_current_device", "current device look-up")
    timer.wrap(engine, "_record", "event record")
    timer.wrap(engine._staging, "take", "staging take (a new buffer)")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "outputs": args.outputs,
              "dependent_launch": args.dependent_launch, "download": args.download, "direct_launch": direct,
              "room_tables": args.room_tables,
              "layers": args.layers,
              "pages": args.pages, "calls": args.calls, "cases": {}}
    for rooms_per_submit in (1, 16):
        for host_pages in (True, False):
            def request(i):
                pages = np.arange(args.pages) + (i % 64) * args.pages + 1
                if not host_pages:
                    pages = torch.as_tensor(pages, device="cuda")
                return RoomRequest(f"r{i}", pages, args.pages * 256 - 100)

            torch.cuda.set_sync_debug_mode(0)  # building device page tables copies from the host
            batches = [[request(i * rooms_per_submit + j) for j in range(rooms_per_submit)] for i in range(args.calls)]
            def submit(batch):  # one room as the hooks submit it (`submit_room`), else a batch
                if len(batch) == 1:
                    room = batch[0]
                    return engine.submit_room(room.key, room.pages, room.n_tokens, lambda _: None)
                return engine.submit(batch, lambda _: None)

            for batch in batches[:20]:  # warm-up: pools fill, the kernel is loaded
                submit(batch)
            torch.cuda.synchronize()
            time.sleep(0.2)
            torch.cuda.set_sync_debug_mode("error")
            timer.totals.clear()
            walls = []
            for batch in batches:
                started = time.perf_counter()
                submit(batch)
                walls.append(time.perf_counter() - started)
                time.sleep(0.0005)  # the collector gives buffers back, as between real batches
            case = f"{rooms_per_submit} room(s)/submit, page tables on {'host' if host_pages else 'device'}"
            parts = {k: 1e6 * v / len(batches) for k, v in timer.totals.items()}
            parts["the rest (tables, copies, staging, ticket, hand-off)"] = (
                1e6 * statistics.mean(walls) - sum(parts.values()))
            report["cases"][case] = {"median_us": median_us(walls), "mean_us": 1e6 * statistics.mean(walls),
                                     "per_room_us": median_us(walls) / rooms_per_submit, "parts_mean_us": parts}
    torch.cuda.set_sync_debug_mode(0)
    report["gaps"] = gap_study(engine, args)
    report["host_ops"] = host_ops(engine, args)
    report["allocation"] = allocation_study(engine, args)
    engine.close()
    report["copied_tables"] = engine.stats.copied_tables
    print(f"submit on {report['device']}, outputs {args.outputs}, dependent launch {args.dependent_launch}, "
          f"room tables {args.room_tables} ({engine.stats.copied_tables} launches copied them up), "
          f"{args.layers} layers x {args.pages} pages per room, "
          f"{args.calls} submits per case; sync debug mode 'error' (no sync raised)")
    for case, r in report["cases"].items():
        print(f"{case:<48} median {r['median_us']:8.1f} us  per room {r['per_room_us']:7.1f} us")
        for part, us in r["parts_mean_us"].items():
            print(f"    {part:<62} {us:8.1f} us")
    print(f"one-room submit after a {args.gap_ms:g} ms gap ({args.gap_calls} submits each):")
    for gap, r in report["gaps"].items():
        print(f"    {gap:<62} median {r['median_us']:8.1f} us  p90 {r['p90_us']:8.1f} us")
    print(f"host-side operations, one at a time (median us; back to back / after a {args.gap_ms:g} ms sleep):")
    for op, r in report["host_ops"].items():
        print(f"    {op:<62} {r['back_to_back_us']:8.2f} / {r['after_gap_us']:8.2f}")
    print(f"decode allocation hook with diagnosis, device page table, one call after each {args.gap_ms:g} ms sleep:")
    for op, r in report["allocation"].items():
        print(f"    {op:<62} median {r['median_us']:8.1f} us  p90 {r['p90_us']:8.1f} us")
    if args.out is not None:
        write_result(args.out, "submit_profile.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
