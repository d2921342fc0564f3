"""What each device call of a hook costs right after a forward, alone and together.

Why: in the serving shape (one probe call per 10 ms model step) a hook call costs
two to four times what it costs back to back (bench/RESULTS.md, `hook_cost
--gap-ms 10`). Whether taking one device call off the serving thread is worth its
design depends on what that call costs there, not hot. Each sequence below is
timed `--calls` times, each time right after a GPU kernel of `--gap-ms` waited on
an event (as a scheduler thread waits for its forward), on the calling thread's
CPU clock; the table gives the median and p99 per sequence:

  nothing          the timer alone
  python           ~500 bytecodes of plain Python (a hook's own share, bench/hook_ops.py)
  launch           a tiny Triton kernel's launch through its compiled launcher
  record           an event recorded on the current stream
  copy             a 4 KB copy down into pinned memory, on the current stream
  launch+record    the two (decode's receipt, step and finish)
  launch+copy+record  the three (prefill's send)

Usage (CUDA):  python3 -m bench.cold_calls [--calls 300] [--gap-ms 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

from bench.harness import percentile, write_result
from dsv4_idxk_probe.testbed.builtin.modeltime import GpuForward


@triton.jit
def _tiny(a_ptr, n):
    i = tl.arange(0, 16)
    tl.store(a_ptr + i, tl.load(a_ptr + i, mask=i < n) + 1, mask=i < n)


def _python() -> None:
    """About 500 bytecodes: a dict, a list, a few attribute reads and calls."""
    d = {}
    for i in range(40):
        d[i] = (i, i + 1)
    sorted(d.items())[:3]


def sequences(device: torch.device) -> dict:
    buf = torch.zeros(16, dtype=torch.int64, device=device)
    host = torch.zeros(4096, dtype=torch.uint8).pin_memory()
    dev4k = torch.zeros(4096, dtype=torch.uint8, device=device)
    event = torch.cuda.Event()

    def launch():
        _tiny[(1,)](buf, 16)

    def record():
        event.record()

    def copy():
        host.copy_(dev4k, non_blocking=True)

    return {
        "nothing": lambda: None,
        "python": _python,
        "launch": launch,
        "record": record,
        "copy": copy,
        "launch+record": lambda: (launch(), record()),
        "launch+copy+record": lambda: (launch(), copy(), record()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--gap-ms", type=float, default=10.0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    forward = GpuForward(device)
    seqs = sequences(device)
    for fn in seqs.values():  # compile and warm each
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    clock = time.thread_time_ns
    samples: dict[str, list[float]] = {name: [] for name in seqs}
    for i in range(args.calls):  # interleaved, so a drift of the host touches every sequence alike
        for name, fn in seqs.items():
            forward(args.gap_ms / 1e3)
            t0 = clock()
            fn()
            samples[name].append((clock() - t0) / 1e3)
    torch.cuda.synchronize()
    rows = {name: {"median": float(np.median(xs)), "p99": percentile(xs, 99)} for name, xs in samples.items()}
    print(f"CPU us per sequence right after a {args.gap_ms:g} ms GPU kernel waited on ({args.calls} each, "
          f"{torch.cuda.get_device_name()})")
    print(f"{'sequence':<20}{'median':>9}{'p99':>9}")
    for name, r in rows.items():
        print(f"{name:<20}{r['median']:>9.1f}{r['p99']:>9.1f}")
    if args.out:
        write_result(args.out, "cold_calls.json", {"calls": args.calls, "gap_ms": args.gap_ms,
                                              "device": torch.cuda.get_device_name(), "sequences": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
