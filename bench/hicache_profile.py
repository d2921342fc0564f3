"""Where restore verification's time goes on the copying thread (issue 30).

Why: `bench.hicache_overhead` prices a wrapped copy call in thread CPU (+160-200 us per
backup and per last-layer load on an H200, 2026-12-03), while the calls the wrapper
makes were counted at ~35 Python and ~45 C calls: the time is in a few of them, or in
the collector thread running beside the copying one. This separates the two:

* per call, wall and thread CPU of the copying thread, for backup and last-layer load,
  bare and wrapped, with the restore collector running as usual and with it held
  (a note posted to each restore engine blocks its collector until the burst is timed);
* cProfile over the wrapped calls (collector running): the functions and C calls, by their
  own time (before Python 3.12 the copying thread's alone; from 3.12 on every thread's, so
  the collector's work shows where it ran during a burst).

Standalone pool (no SGLang), index checks on (the default), round trip off.

Usage:  python3 -m bench.hicache_profile [--device cuda] [--calls 800] [--burst 16] [--top 18]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import threading
import time

import torch

from bench.harness import Table, median
from bench.hicache_overhead import LAYERS, Installed, StandalonePool, closed_cleanly, indices
from dsv4_idxk_probe.hicache import probe_for
from dsv4_idxk_probe.safety import error_counts


def _engines(inst) -> list:
    restore = probe_for(inst.runtime).restore
    if restore is None:
        return []
    return [p.engine for p in list(restore._pools.values()) if p is not None]


def timed(fn, calls: int, burst: int, inst, hold: bool) -> tuple[float, float]:
    """Wall and thread CPU per call (us), in bursts; between bursts the collector catches up.
    `hold`: the collector is blocked for the whole burst (it runs nothing beside the calls)."""
    wall = cpu = 0.0
    done = 0
    while done < calls:
        gate = threading.Event()
        if hold and inst is not None:
            for engine in _engines(inst):
                engine.post(lambda _arg, g=gate: g.wait(30.0))
        n = min(burst, calls - done)
        w0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            fn()
        wall += time.perf_counter() - w0
        cpu += time.thread_time() - c0
        gate.set()
        done += n
        if inst is not None:
            inst.drain()
    return 1e6 * wall / calls, 1e6 * cpu / calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--calls", type=int, default=800)
    p.add_argument("--burst", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--top", type=int, default=18)
    args = p.parse_args(argv)
    errors_before = error_counts()
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    pool = StandalonePool(dev)
    host, device = indices(0, dev), indices(8, dev)
    cases = {
        "backup": lambda: pool.backup_from_device_all_layer(None, host, device, "kernel"),
        # a whole load (its last layer completes it and brings the digest), per "call"
        "load, every layer": lambda: [pool.load_to_device_per_layer(None, host, device, layer, "kernel")
                                      for layer in range(LAYERS)],
    }
    inst = Installed(StandalonePool, True)
    with inst:  # the pool's registration and its engine's start, outside every timing
        for fn in cases.values():
            fn()
        inst.drain()
    rows = []
    for case, fn in cases.items():
        got: dict[str, list] = {"bare": [], "wrapped, collector running": [], "wrapped, collector held": []}
        for _ in range(args.rounds):
            got["bare"].append(timed(fn, args.calls, args.burst, None, False))
            with inst:
                got["wrapped, collector running"].append(timed(fn, args.calls, args.burst, inst, False))
                got["wrapped, collector held"].append(timed(fn, args.calls, args.burst, inst, True))
        bare_wall = median(w for w, _ in got["bare"])
        bare_cpu = median(c for _, c in got["bare"])
        for variant, samples in got.items():
            wall, cpu = median(w for w, _ in samples), median(c for _, c in samples)
            rows.append((case, variant, wall, wall - bare_wall, cpu, cpu - bare_cpu))
    print(f"device={args.device} layers={LAYERS} calls={args.calls} burst={args.burst} rounds={args.rounds} "
          "(medians over rounds, us per call)")
    table = Table(("case", "<18"), ("variant", "<28"), ("wall", "8.1f"), ("added", "8.1f"), ("thread CPU", "10.1f"),
                  ("added", "8.1f"))
    print(table.header())
    for row in rows:
        print(table.row(*row))

    for case, fn in cases.items():
        profile = cProfile.Profile()
        with inst:
            done = 0
            while done < args.calls:
                profile.enable()  # from Python 3.12 on, cProfile sees every thread: the collector's work too
                for _ in range(args.burst):
                    fn()
                profile.disable()
                done += args.burst
                inst.drain()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
        print(f"\ncProfile, copying thread, wrapped {case}, {done} calls (collector running), by own time:")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])
    return 0 if closed_cleanly([inst], errors_before) else 1


if __name__ == "__main__":
    raise SystemExit(main())
