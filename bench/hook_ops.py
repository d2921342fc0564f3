"""How much work one probe call does on the serving thread, counted rather than timed.

Why: on the H200 host (and on the CPU dev machine) any operation made right
after 10 ms of other work costs 20-160 us however cheap it is back to back
(bench/RESULTS.md, host-side operations), and every probe call of a serving
loop comes after such a gap. So a call's cost there follows how many
functions it runs, not how long they take hot, and timing it on a quiet
machine says little (`bench/hook_cost.py` times it all the same). This counts,
per call, on the calling thread: Python functions entered, C functions called,
and Python bytecodes executed. The counts are deterministic, so a change to the
hot path shows its effect in one run on any machine.

The calls are the product's own, as the SGLang hooks make them (DecodeMonitor.
room_received, a `decode_step` batch and a finishing batch through DecodeMonitor.
batch_done, DecodeMonitor.room_finished, PrefillMonitor.room_sent), each monitor
on a DigestEngine set up as `DigestEngine.from_config` sets up its role's (decode
copies its outputs down on the collector, prefill at submit), taking its CUDA
path with its device touch points replaced by fakes, as no GPU is needed to
count: the compiled kernel's C launch function, the device and current-stream
look-ups and the event record are each faked by a C callable (one C call, as
the real one), the event pool holds fake events. The collector threads run, as
in serving, but only the calling thread is counted.

Page tables are CPU tensors the engine reads in place (`--page-tables device`,
the default: what a device page table costs the serving thread, which SGLang
passes), or host lists that travel in the staging upload (`--page-tables host`,
what this bench used before 2026-12-03). Prefill's send takes the hook's table in
either case: its slice of the request table, the room's token indices (SGLang's
`req_to_token` is on the device), read by an engine of `page_id_stride` 256
(`bench.hook_cost.request_table`); before 2026-12-05 it took page ids.

`--diagnosis` turns decode's diagnosis on (shipped bounds, allocation
snapshot on) and adds the allocation hook (`DecodeMonitor.room_allocated`:
the snapshot's submit; its journal event is made on the collector).

Usage:  python3 -m bench.hook_ops [--layers 30] [--pages 17] [--calls 200] [--step-rooms 8] [--diagnosis]
                                  [--page-tables device|host] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import operator
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.harness import CallCounter, Table, median, write_result
from dsv4_idxk_probe.config import DiagnosisConfig
from dsv4_idxk_probe.diagnosis.tracker import decode_diagnosis
from dsv4_idxk_probe.digest import DigestEngine, get_layout
from dsv4_idxk_probe.digest.launch import DirectLaunch, staging_bytes
from dsv4_idxk_probe.pd import DecodeMonitor, PrefillMonitor, RoomId


class FakeEvent:
    """A CUDA event stand-in: complete as soon as it is recorded."""

    def record(self, stream=None):
        self.recorded = True

    def query(self):
        return True

    def synchronize(self):
        pass


def fake_device_calls(engine: DigestEngine, events: int = 64) -> DigestEngine:
    """Make `engine` (Triton backend, host buffers) take its CUDA submit path with every
    device touch point faked by a C callable, so that a count sees one C call where the
    real call is one: the current-device and raw-stream look-ups, the event record, and
    the compiled kernel's C launch function (`DirectLaunch`, as learnt on a GPU). The
    event pool starts with `events` fake events (the collector gives them back). The
    engine's own device stays the CPU: page tables that are CPU tensors are read in
    place, as device ones are on a GPU."""
    engine._on_cuda = True
    engine._device_index = 0
    engine._current_device = int  # int() == 0: the engine's device
    engine._raw_stream = {0: 7}.__getitem__
    engine._streams[7] = "stream"  # what `_stream_object` makes once: the torch stream the event is recorded on
    engine._record = operator.is_  # (event, stream): one C call
    engine._events._free.extend(FakeEvent() for _ in range(events))
    engine._events.take = lambda timing=False: FakeEvent()
    hooks = engine._launch_hooks
    enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
    calls = [getattr(hook, "calls", ()) if hook is not None else () for hook in (enter, leave)]
    for one in (False, True):  # `itertools.chain` takes any arguments and does nothing with them: one C call
        tail = engine._kernel.launch_args(0, 0, 0, 0, (0, 8, 1, 1) if one else None)[9:]
        engine._direct[one] = DirectLaunch(itertools.chain, ("cu-function", 0, engine._kernel.pdl), tail, True,
                                           enter, leave, *calls)
    allocate = engine._staging._allocate

    def zeroed(size):  # the faked kernel stores nothing: zeroed outputs read as in-range rows
        staging = allocate(size)
        for buffer in (staging.host, staging.device):
            if buffer is not None:
                buffer.zero_()
        return staging

    engine._staging._allocate = zeroed
    # what the engine reserves at start-up on CUDA (a CPU engine reserves none), zeroed
    engine._staging.min_free.clear()
    engine._staging.reserve(staging_bytes(32 + 64, len(engine.layer_ids) * 64, len(engine.layout.segments)), 32)
    return engine


def cuda_path_engine(layers: int, pages: int, **options) -> DigestEngine:
    """A DigestEngine on host buffers that takes its CUDA submit path, device calls faked.
    `options`: the engine's own (contents on and the copy down at submit unless given)."""
    layout = get_layout("fp8")
    buffers = [torch.zeros(pages + 2, layout.row_bytes, dtype=torch.uint8) for _ in range(layers)]
    engine = DigestEngine(layout, list(range(layers)), buffers, backend="triton",
                          **{"contents": True, "download": "submit", **options})
    return fake_device_calls(engine)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--pages", type=int, default=17)
    p.add_argument("--calls", type=int, default=200, help="calls of each kind; counts are per call (median)")
    p.add_argument("--step-rooms", type=int, default=8, help="rooms of the `decode_step` batch")
    p.add_argument("--diagnosis", action="store_true", help="decode's diagnosis on (shipped bounds, snapshot on)")
    p.add_argument("--page-tables", choices=("device", "host"), default="device")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    from bench.hook_cost import PAGE_TOKENS, fake_engines, request_table  # each role's engine as the probe sets it up

    decode_engine, prefill_engine = fake_engines(args.layers, args.pages, args.diagnosis)
    diagnosis = None
    if args.diagnosis:
        diagnosis = decode_diagnosis(SimpleNamespace(diagnosis=DiagnosisConfig(enabled=True)), decode_engine.layout,
                                     decode_engine.layer_ids)
    decode = DecodeMonitor(decode_engine, lambda record: None, diagnosis=diagnosis, snapshot_on_allocation=True)
    prefill = PrefillMonitor(prefill_engine, lambda record: None)
    ids = list(range(1, args.pages + 1))
    pages = torch.tensor(ids, dtype=torch.int64) if args.page_tables == "device" else ids
    tokens = args.pages * PAGE_TOKENS - 100
    requests = request_table(1, args.pages, "cpu")  # prefill's send: the room's token indices (hook_cost's `send`)
    counter, results = CallCounter(), {}
    room_no = iter(range(10**9))

    def received() -> RoomId:
        room = RoomId(next(room_no))
        if diagnosis is not None:
            decode.room_allocated(room, pages, tokens, snapshot=False)
        decode.room_received(room, pages, tokens, None, {"rid": f"req-{room.room}"})
        time.sleep(0.001)  # the collector takes the receipt first
        return room

    def allocation():
        room = RoomId(next(room_no))
        return lambda: decode.room_allocated(room, pages, tokens)

    def receipt():
        room = RoomId(next(room_no))
        if diagnosis is not None:
            decode.room_allocated(room, pages, tokens, snapshot=False)
        extra = {"rid": f"req-{room.room}"}
        return lambda: decode.room_received(room, pages, tokens, None, extra)

    stepped = []

    def step():
        if not stepped:
            stepped.extend((received(), 64) for _ in range(args.step_rooms))
        return lambda: decode.batch_done([], stepped)

    def finishing_batch():
        room = received()
        return lambda: decode.batch_done([room], [])

    def finish():
        room = received()
        return lambda: decode.room_finished(room)

    def send():
        room = RoomId(next(room_no))
        extra = {"rid": f"req-{room.room}"}
        return lambda: prefill.room_sent(room, requests[0, :tokens], tokens, extra)

    cases = {"decode allocation (room_allocated)": allocation} if diagnosis is not None else {}
    cases.update({"decode receipt (room_received)": receipt,
                  f"decode step batch of {args.step_rooms} rooms (batch_done)": step,
                  "decode finishing batch of one room (batch_done)": finishing_batch,
                  "decode finish of one room (room_finished)": finish,
                  "prefill send (slice, room_sent)": send})
    for name, make in cases.items():
        samples = []
        for _ in range(args.calls):
            while decode_engine.backlog() or prefill_engine.backlog():  # buffers and events back in their pools,
                time.sleep(0.0005)  # as between real calls: each call counted from the same state
            samples.append(counter.count(make))
        results[name] = {key: median(s[key] for s in samples) for key in samples[0]}
    decode_engine.close()
    prefill_engine.close()
    print(f"serving-thread work per probe call ({args.layers} layers x {args.pages} pages per room; "
          f"diagnosis {'on' if args.diagnosis else 'off'}; page tables: {args.page_tables}; device calls faked; "
          f"medians over the calls)")
    table = Table(("call", "<50"), ("Python calls", "12.0f"), ("C calls", "8.0f"), ("bytecodes", "10.0f"))
    print(table.header())
    for name, r in results.items():
        print(table.row(name, r["python_calls"], r["c_calls"], r["opcodes"]))
    if args.out is not None:
        write_result(args.out, "hook_ops.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
