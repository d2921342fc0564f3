"""What one probe call costs the serving thread, timed: median and p99 per hook kind.

Why: `bench/hook_ops.py` counts the Python work of a hook call (deterministic, any
machine); this times it. Each kind is called `--calls` times (one call per room or per
batch, as the SGLang hooks call the monitors), each call timed alone on the calling
thread in thread CPU time and in wall time, and the table gives the median and the 99th
percentile of each. The collector thread runs as in serving (it folds, judges and
writes records on the other core); between calls the caller sleeps `--gap-ms` (default
0.2 ms, too little for the collectors to keep up: see `--burst`; a serving thread comes back
from a model step of 10-30 ms, which `--gap-ms 10` mimics), and every 64 calls it waits for the
collector to drain, so no batch is ever dropped. `--gap-wait gpu` (CUDA) passes the gap
as a scheduler thread passes its forward: a GPU kernel of that length, waited on an event
(on the H200 host a call right after a sleep costs more than one after such a wait).
`--burst K`: K calls one after the other per gap, as a scheduler step that receives or
finishes K rooms makes them (with `--gap-ms 10`, the shape of serving: at 0.2 ms gaps the
bench submits ~4,000 batches a second, more than one collector finishes, so the backlog
grows whatever the collector does; the report's collector CPU per call says by how much).

Hook kinds, as the SGLang hooks (sglang/pd_decode.py, pd_prefill.py) call the monitors,
with decode's diagnosis on as shipped (`--no-diagnosis`: verification alone):
  allocate  DecodeMonitor.room_allocated (`_send_kv_metadata`: journal, allocation snapshot)
  receive   DecodeMonitor.room_received (`_commit_transfer_to_req`: `decode_recv`)
  step      DecodeMonitor.batch_done with `--step-rooms` rooms stepped (every `step_interval`-th batch)
  finish    DecodeMonitor.room_finished (`release_kv_cache`: `decode_finish` of one room)
  send      PrefillMonitor.room_sent (`send_kv_chunk(last_chunk=True)`: `prefill_send`), with
            the hook's slice of the request table: the room's token indices (int32, 256 per
            page), which prefill's engine reads with `page_id_stride` 256 as `PrefillSide`
            builds it (before 2026-12-05 the hook divided them into page ids first, a device
            op this bench never timed; it timed the monitor call on page ids).
            `--send-table divided` times that former hook: slice, division, a call on page ids

`--real-launch` (the default where CUDA is present): a real engine on CUDA buffers
(DeepSeek-V4 fp8 rows), page tables as CUDA int64 tensors, the kernel really launched.
`--fake-launch` (the only choice without CUDA): the engine's device touch points
faked as in `bench/hook_ops.py` (the kernel launch, the stream look-up, the event
record), page tables as host tensors the engine reads in place, as it reads device
ones (`--page-tables host`: host lists, which travel in the staging upload).

Usage:  python -m bench.hook_cost [--calls 2000] [--layers 30] [--pages 17] [--step-rooms 8] [--kinds LIST]
                                  [--gap-ms 0.2] [--gap-wait sleep|gpu] [--burst 1] [--no-diagnosis]
                                  [--real-launch | --fake-launch]
                                  [--page-tables device|host] [--send-table tokens|divided] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from bench.harness import Table, percentile, write_result
from dsv4_idxk_probe.config import DiagnosisConfig
from dsv4_idxk_probe.diagnosis.tracker import decode_diagnosis
from dsv4_idxk_probe.digest import DigestEngine, get_layout
from dsv4_idxk_probe.pd import DecodeMonitor, PrefillMonitor, RoomId

KINDS = ("allocate", "receive", "step", "finish", "send")
#: Tokens per page of the pools the benches' page tables address (DeepSeek-V4's).
PAGE_TOKENS = 256


def real_engines(layers: int, pages: int, contents: bool, stride: int = PAGE_TOKENS) -> tuple[DigestEngine, DigestEngine]:
    """Decode's and prefill's engines on CUDA buffers, set up as `DigestEngine.from_config`
    sets them up for each role with the shipped config."""
    layout = get_layout("fp8")
    pool = 64 * pages + 1
    buffers = [torch.randint(0, 256, (pool, layout.row_bytes), dtype=torch.uint8, device="cuda") for _ in range(layers)]
    decode = DigestEngine(layout, list(range(layers)), buffers, **_role_options("decode", contents))
    prefill = DigestEngine(layout, list(range(layers)), buffers, **_role_options("prefill", contents),
                           page_id_stride=stride)
    return decode, prefill


def _role_options(role: str, diagnosis: bool) -> dict:
    """`DigestEngine.role_options` with the shipped config (decode's diagnosis as asked); an
    engine from before that method gets the contents choice alone and its own defaults."""
    from dsv4_idxk_probe.config import parse_config

    options = getattr(DigestEngine, "role_options", None)
    if options is None:
        return {"contents": diagnosis and role == "decode"}
    return options(parse_config({"diagnosis": {"enabled": diagnosis}}), role)


def fake_engines(layers: int, pages: int, contents: bool, stride: int = PAGE_TOKENS) -> tuple[DigestEngine, DigestEngine]:
    """As `real_engines`, device touch points faked (`bench.hook_ops`); `stride`: prefill's
    `page_id_stride` (1 for `--send-table divided`)."""
    from bench.hook_ops import cuda_path_engine

    return (cuda_path_engine(layers, pages, **_role_options("decode", contents)),
            cuda_path_engine(layers, pages, **_role_options("prefill", contents), page_id_stride=stride))


def page_ids(n: int, pages: int) -> list[np.ndarray]:
    """`n` rooms' page ids, `pages` each, over a pool of 64 rooms' pages."""
    return [np.arange(pages) + (i % 64) * pages + 1 for i in range(n)]


def page_tables(n: int, pages: int, where: str, device: str) -> list:
    """`n` rooms' page tables of `pages` pages each, over a pool of 64 rooms' pages."""
    return [ids.tolist() if where == "host" else torch.as_tensor(ids, dtype=torch.int64, device=device)
            for ids in page_ids(n, pages)]


def request_table(n: int, pages: int, device: str) -> torch.Tensor:
    """What prefill's hook slices a room's table from (SGLang's `req_to_token`): `n` rows of
    int32 token indices, `PAGE_TOKENS` per page, row i over the pages of `page_ids`."""
    rows = [torch.as_tensor(ids, dtype=torch.int32).repeat_interleave(PAGE_TOKENS) * PAGE_TOKENS
            + torch.arange(PAGE_TOKENS, dtype=torch.int32).repeat(pages) for ids in page_ids(n, pages)]
    return torch.stack(rows).to(device)


def count_serving_allocations(engines) -> list[int]:
    """A one-item list counting the staging buffers the engines' pools allocate on this
    thread (a `take` that found its size class empty), not the collector's refills, which
    the pools' own `allocations` counts too."""
    serving, count = threading.get_ident(), [0]
    for engine in engines:
        pool = engine._staging
        allocate = pool._allocate

        def counted(size, allocate=allocate):
            if threading.get_ident() == serving:
                count[0] += 1
            return allocate(size)

        pool._allocate = counted
    return count


def thread_cpu_s(engines) -> float:
    """CPU seconds the engines' collector threads have used so far (0 for one not running)."""
    total = 0.0
    for engine in engines:
        thread = engine._thread
        if thread is not None and thread.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except (OSError, ProcessLookupError):  # ended meanwhile
                pass
    return total


def table_reads(decode_engine: DigestEngine, prefill_engine: DigestEngine) -> dict:
    """Where the engines' kernels read their room tables (issue 32: the step's launch reads
    them from the pinned buffer in place, no copy up), and how many launches copied them
    up all the same: an engine from before the option reports "copied up"."""
    copied = {role: getattr(engine.stats, "copied_tables", None)
              for role, engine in (("decode", decode_engine), ("prefill", prefill_engine))}
    mapped = all(getattr(engine, "mapped_tables", False) and engine._staging.__dict__.get("mapped", False)
                 for engine in (decode_engine, prefill_engine))
    return {"where": "read in place from pinned memory" if mapped else "copied up", "copied": copied}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000, help="timed calls of each kind")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--pages", type=int, default=17)
    p.add_argument("--step-rooms", type=int, default=8, help="rooms stepped by each `step` call (one launch)")
    p.add_argument("--gap-ms", type=float, default=0.2, help="time passed before each timed call")
    p.add_argument("--gap-wait", choices=("sleep", "gpu"), default="sleep",
                   help="how: a sleep, or (CUDA) a GPU kernel waited on, as a forward is")
    p.add_argument("--burst", type=int, default=1, help="calls one after the other per gap (a step's rooms)")
    p.add_argument("--no-diagnosis", dest="diagnosis", action="store_false", help="decode's diagnosis off")
    launch = p.add_mutually_exclusive_group()
    launch.add_argument("--real-launch", dest="real", action="store_true", default=None,
                        help="a real engine on CUDA (the default where CUDA is present)")
    launch.add_argument("--fake-launch", dest="real", action="store_false", help="device touch points faked")
    p.add_argument("--page-tables", choices=("device", "host"), default="device")
    p.add_argument("--send-table", choices=("tokens", "divided"), default="tokens",
                   help="send: the request table's slice as it is (the hook since 2026-12-05), or divided "
                        "into page ids first for an engine without a stride (the hook before)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"which kinds, in this order (of {','.join(KINDS)})")
    p.add_argument("--warm-up", type=int, default=50, help="untimed calls of each kind first")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    real = cuda if args.real is None else args.real
    if real and not cuda:
        print("--real-launch needs CUDA", file=sys.stderr)
        return 2
    if args.burst < 1:
        print(f"--burst must be at least 1, got {args.burst}", file=sys.stderr)
        return 2
    stride = PAGE_TOKENS if args.send_table == "tokens" else 1
    decode_engine, prefill_engine = (real_engines if real else fake_engines)(args.layers, args.pages, args.diagnosis,
                                                                             stride)
    diagnosis = None
    if args.diagnosis:
        diagnosis = decode_diagnosis(SimpleNamespace(diagnosis=DiagnosisConfig(enabled=True)), decode_engine.layout,
                                     decode_engine.layer_ids)
    decode = DecodeMonitor(decode_engine, lambda record: None, diagnosis=diagnosis,
                           snapshot_on_allocation=args.diagnosis, step_interval=64)
    prefill = PrefillMonitor(prefill_engine, lambda record: None)
    device = "cuda" if real else "cpu"
    n_rooms = args.calls + args.warm_up
    tables = page_tables(max(64, args.step_rooms), args.pages, args.page_tables, device)
    tokens = args.pages * PAGE_TOKENS - 100
    requests = request_table(64, args.pages, device)
    inband = None  # no prefill digest: "unverified" at every stage, the collector's lightest path
    gap = args.gap_ms / 1e3
    wait = time.sleep
    if args.gap_wait == "gpu":
        if not cuda:
            print("--gap-wait gpu needs CUDA", file=sys.stderr)
            return 2
        from dsv4_idxk_probe.testbed.builtin.modeltime import GpuForward

        forward = GpuForward(torch.device("cuda"))
        done = torch.cuda.Event()

        def forward_and_wait(seconds):
            forward(seconds)
            done.record()
            done.synchronize()

        wait = forward_and_wait
    rooms = iter(range(10**9))
    engines = (decode_engine, prefill_engine)
    serving_allocations = count_serving_allocations(engines)

    def drain() -> None:
        for engine in engines:
            while engine.backlog():
                time.sleep(0.0005)

    def timed(kind, setups):
        """Each setup() returns the call to time; `n_rooms` of them, the first warm-up ones untimed.
        Beside the times, the two signs of a collector that falls behind: the staging buffers
        the timed calls allocated on this thread (a size class found empty) and the batches
        not yet delivered right after each timed call (its own included). Both are read off
        the timed call's approach: nothing runs between the wait and the call. And the
        collectors' CPU per timed call (their work for the setups' submits included), against
        which the time between calls says whether they can keep up."""
        cpu, wall, backlog = [], [], []
        allocated = 0
        collector_cpu = 0.0
        for i in range(n_rooms):
            call = setups()  # its own submits (a receipt's snapshot, a finish's receipt) are not the call's
            if i % 64 == 0:
                drain()
            if i == args.warm_up:
                collector_cpu = thread_cpu_s(engines)
            before = serving_allocations[0]  # the wait allocates nothing on this thread
            if i % args.burst == 0:
                wait(gap)
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            call()
            w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            if i >= args.warm_up:
                cpu.append((c1 - c0) / 1e3)
                wall.append((w1 - w0) / 1e3)
                backlog.append(sum(engine.backlog() for engine in engines))
                allocated += serving_allocations[0] - before
        drain()
        collector_cpu = thread_cpu_s(engines) - collector_cpu
        return {"cpu_us": {"median": percentile(cpu, 50), "p99": percentile(cpu, 99), "mean": float(np.mean(cpu))},
                "wall_us": {"median": percentile(wall, 50), "p99": percentile(wall, 99), "mean": float(np.mean(wall))},
                "calls": len(cpu), "staging_allocations": allocated,
                "backlog": {"median": percentile(backlog, 50), "max": max(backlog)},
                "collector_cpu_us_per_call": collector_cpu * 1e6 / max(1, len(cpu))}

    def new_room(received: bool):
        room = RoomId(next(rooms))
        pages = tables[room.room % len(tables)]
        if received:
            if diagnosis is not None:
                decode.room_allocated(room, pages, tokens)
            decode.room_received(room, pages, tokens, inband, {"rid": f"req-{room.room}"})
        return room, pages

    def allocate():
        room = RoomId(next(rooms))
        pages = tables[room.room % len(tables)]
        return lambda: decode.room_allocated(room, pages, tokens)

    def receive():
        room = RoomId(next(rooms))
        pages = tables[room.room % len(tables)]
        if diagnosis is not None:
            decode.room_allocated(room, pages, tokens)
        extra = {"rid": f"req-{room.room}"}
        return lambda: decode.room_received(room, pages, tokens, inband, extra)

    stepped = []

    def step():
        if not stepped:  # rooms that stay received, stepped again and again
            stepped.extend((new_room(True)[0], 64) for _ in range(args.step_rooms))
        return lambda: decode.batch_done((), stepped)

    def finish():
        room, _ = new_room(True)
        return lambda: decode.room_finished(room)

    def send():
        room = RoomId(next(rooms))
        row = room.room % len(requests)
        extra = {"rid": f"req-{room.room}"}
        if stride == 1:  # the hook before 2026-12-05: page ids made on the table's device, then the call
            return lambda: prefill.room_sent(room, requests[row, :tokens][::PAGE_TOKENS] // PAGE_TOKENS, tokens, extra)
        return lambda: prefill.room_sent(room, requests[row, :tokens], tokens, extra)  # the hook's slice, then the call

    every = {"allocate": allocate, "receive": receive, "step": step, "finish": finish, "send": send}
    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in every]
    if unknown:
        print(f"unknown hook kinds {unknown}; known: {', '.join(KINDS)}", file=sys.stderr)
        return 2
    cases = {kind: every[kind] for kind in kinds if kind != "allocate" or args.diagnosis}
    results = {}
    for kind, setup in cases.items():
        results[kind] = timed(kind, setup)
    for room, _ in stepped:
        decode.room_finished(room)
    drain()
    decode_engine.close()
    prefill_engine.close()
    where = (f"real launches on {torch.cuda.get_device_name()}" if real else
             "device touch points faked (bench/hook_ops.py)")
    print(f"serving-thread cost per hook call, {args.calls} calls each ({args.layers} layers x {args.pages} pages "
          f"per room; step: {args.step_rooms} rooms; diagnosis {'on' if args.diagnosis else 'off'}; {where}; "
          f"page tables: {args.page_tables}; send table: {args.send_table}; {args.gap_ms:g} ms of {args.gap_wait} "
          f"before each {'call' if args.burst == 1 else f'{args.burst} calls'})")
    table = Table(("hook", "<10"), ("CPU median us", ">14.1f"), ("CPU p99 us", ">11.1f"),
                  ("wall median us", ">15.1f"), ("wall p99 us", ">12.1f"), ("allocated", ">10d"),
                  ("backlog median", ">15.0f"), ("backlog max", ">12d"), ("collector us/call", ">18.1f"))
    print(table.header())
    for kind, r in results.items():
        print(table.row(kind, r["cpu_us"]["median"], r["cpu_us"]["p99"], r["wall_us"]["median"], r["wall_us"]["p99"],
                        r["staging_allocations"], r["backlog"]["median"], r["backlog"]["max"],
                        r["collector_cpu_us_per_call"]))
    print("allocated: staging buffers the timed calls allocated on the serving thread (their size class empty); "
          "backlog: batches the collectors had not delivered right after a call (its own included); "
          "collector us/call: the collectors' CPU per timed call (their work for its setup's submits included)")
    tables = table_reads(decode_engine, prefill_engine)
    print(f"room tables: {tables['where']} (launches that copied their tables up: decode "
          f"{tables['copied']['decode']}, prefill {tables['copied']['prefill']})")
    if args.out is not None:
        report = {"device": torch.cuda.get_device_name() if real else "cpu", "real_launch": real,
                  "torch": torch.__version__, "calls": args.calls, "layers": args.layers, "pages": args.pages,
                  "step_rooms": args.step_rooms, "gap_ms": args.gap_ms, "gap_wait": args.gap_wait, "burst": args.burst,
                  "diagnosis": args.diagnosis,
                  "page_tables": args.page_tables, "send_table": args.send_table, "room_tables": tables,
                  "kinds": results}
        write_result(args.out, "hook_cost.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
