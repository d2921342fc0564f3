"""How much work one probe call does on the serving thread, counted rather than timed.

Why: on the H200 host (and on the CPU dev machine) any operation made right
after 10 ms of other work costs 20-160 us however cheap it is back to back
(bench/RESULTS.md, host-side operations), and every probe call of a serving
loop comes after such a gap. So a call's cost there follows how many
functions it runs, not how long they take hot, and timing it on a quiet
machine says little. This counts, per call, on the calling thread: Python
functions entered, C functions called, and Python bytecodes executed. The
counts are deterministic, so a change to the hot path shows its effect in
one run on any machine.

The calls are the product's own (DecodeMonitor.room_received, a finishing
DecodeMonitor.batch_done, PrefillMonitor.room_sent) on a DigestEngine
taking its CUDA path, down to `DigestKernel.launch`, with its three device
touch points replaced by fakes, as no GPU is needed to count: the compiled
kernel's C launcher, the current-stream look-up and the event pool (each
fake is one Python call where the real one is a C call or a Python
function of its own). The collector thread runs, as in serving, but only
the calling thread is counted.

`--diagnosis` turns decode's diagnosis on (shipped bounds, allocation
snapshot on) and adds the allocation hook (`DecodeMonitor.room_allocated`:
a journal event and the snapshot's submit); receipt and finish then journal
too. Page tables are host lists here, so the device-to-host copy of a
device page table (`host_ids.capture`: a pinned buffer, a copy, an event)
is not counted.

Usage:  python3 bench/hook_ops.py [--layers 30] [--pages 17] [--calls 200] [--diagnosis] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4_idxk_probe.config import DiagnosisConfig  # noqa: E402
from dsv4_idxk_probe.diagnosis.tracker import decode_diagnosis  # noqa: E402
from dsv4_idxk_probe.digest import DigestEngine, get_layout  # noqa: E402
from dsv4_idxk_probe.pd import DecodeMonitor, PrefillMonitor, RoomId  # noqa: E402


class FakeEvent:
    """A CUDA event stand-in: complete as soon as it is recorded."""

    def record(self, stream=None):
        self.recorded = True

    def query(self):
        return True

    def synchronize(self):
        pass


class Counter:
    """Counts Python calls, C calls and bytecodes on this thread while active."""

    def __init__(self):
        self.calls = self.c_calls = self.opcodes = 0

    def _profile(self, frame, event, arg):
        if event == "call":
            self.calls += 1
        elif event == "c_call":
            self.c_calls += 1

    def _trace(self, frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            self.opcodes += 1
        return self._trace

    def count(self, make) -> dict:
        """Counts one call made by `make()` with the profiler, then another with the tracer
        (they cannot run together); `make` sets up each call outside the count."""
        self.calls = self.c_calls = self.opcodes = 0
        call = make()
        sys.setprofile(self._profile)
        try:
            call()
        finally:
            sys.setprofile(None)
        calls, c_calls = self.calls, self.c_calls
        call = make()
        sys.settrace(self._trace)
        try:
            call()
        finally:
            sys.settrace(None)
        return {"python_calls": calls, "c_calls": c_calls, "opcodes": self.opcodes}


def cuda_path_engine(layers: int, pages: int) -> DigestEngine:
    """A DigestEngine on host buffers that takes its CUDA submit path, device calls faked."""
    layout = get_layout("fp8")
    buffers = [torch.zeros(pages + 2, layout.row_bytes, dtype=torch.uint8) for _ in range(layers)]
    engine = DigestEngine(layout, list(range(layers)), buffers, backend="triton")
    engine.device = torch.device("cuda")  # the submit path branches on it; nothing here allocates on it
    engine._current_stream = lambda: (0, 0)
    fake = SimpleNamespace(run=lambda *args: None, function=1, packed_metadata=())
    engine._kernel.compiled = {False: fake, True: fake}  # the kernel for several rooms, and for one
    engine._kernel.compiled_on = {False: 0, True: 0}
    engine._events.take = lambda timing=False: FakeEvent()
    engine._streams[0] = "stream"  # what `_stream_object` makes once: the torch stream the event is recorded on
    allocate = engine._staging._allocate

    def zeroed(size):  # the faked kernel stores nothing: zeroed outputs read as in-range rows
        staging = allocate(size)
        for buffer in (staging.host, staging.device):
            if buffer is not None:
                buffer.zero_()
        return staging

    engine._staging._allocate = zeroed
    return engine


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--pages", type=int, default=17)
    p.add_argument("--calls", type=int, default=200, help="calls of each kind; counts are per call (median)")
    p.add_argument("--diagnosis", action="store_true", help="decode's diagnosis on (shipped bounds, snapshot on)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    engine = cuda_path_engine(args.layers, args.pages)
    diagnosis = None
    if args.diagnosis:
        diagnosis = decode_diagnosis(SimpleNamespace(diagnosis=DiagnosisConfig(enabled=True)), engine.layout,
                                     engine.layer_ids)
    decode = DecodeMonitor(engine, lambda record: None, diagnosis=diagnosis, snapshot_on_allocation=True)
    prefill = PrefillMonitor(engine, lambda record: None)
    pages, tokens = list(range(1, args.pages + 1)), args.pages * 256 - 100
    counter, results = Counter(), {}
    room_no = iter(range(10**9))

    def allocation():
        room = RoomId(next(room_no))
        return lambda: decode.room_allocated(room, pages, tokens)

    def receipt():
        room = RoomId(next(room_no))
        if diagnosis is not None:
            decode.room_allocated(room, pages, tokens, snapshot=False)
        return lambda: decode.room_received(room, pages, tokens, None)

    def finish():
        room = RoomId(next(room_no))
        if diagnosis is not None:
            decode.room_allocated(room, pages, tokens, snapshot=False)
        decode.room_received(room, pages, tokens, None)
        time.sleep(0.001)  # the collector takes the receipt first
        return lambda: decode.batch_done([room], [])

    cases = {"decode allocation (room_allocated)": allocation} if diagnosis is not None else {}
    cases.update({"decode receipt (room_received)": receipt,
             "decode finishing batch of one room (batch_done)": finish,
             "prefill send (room_sent)": lambda: lambda: prefill.room_sent(RoomId(next(room_no)), pages, tokens)})
    for name, make in cases.items():
        samples = []
        for _ in range(args.calls):
            samples.append(counter.count(make))
            time.sleep(0.0005)  # the collector hands buffers back, as between real calls
        results[name] = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
    engine.close()
    print(f"serving-thread work per probe call ({args.layers} layers x {args.pages} pages per room; "
          f"diagnosis {'on' if args.diagnosis else 'off'}; device calls faked; medians over the calls)")
    print(f"{'call':<50} {'Python calls':>12} {'C calls':>8} {'bytecodes':>10}")
    for name, r in results.items():
        print(f"{name:<50} {r['python_calls']:12.0f} {r['c_calls']:8.0f} {r['opcodes']:10.0f}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hook_ops.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
