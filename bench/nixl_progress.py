"""How much CPU a NIXL agent's progress thread takes while its process is idle.

Why: inside the rig's processes every CUDA call and the Python around it cost
3-8x more than alone (bench/RESULTS.md). Each rig process holds a NIXL agent
with the UCX backend and a progress thread, created as SGLang's NIXL
connector creates its own (`enable_prog_thread` on, NIXL's Python API sets no
delay between progress calls). This measures the process's CPU time while
its main thread sleeps, with no agent, then with one; and a fixed loop of
plain Python on the main thread in both cases.

Usage:  python3 -m bench.nixl_progress [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import queue
import sys
import time

from bench.harness import median


def measure(label: str, seconds: float) -> dict:
    q: queue.Queue = queue.Queue()
    samples = []
    for _ in range(30):
        started = time.perf_counter()
        for i in range(2000):
            q.put_nowait(i)
            q.get_nowait()
        samples.append((time.perf_counter() - started) / 2000 * 1e6)
    cpu = time.process_time()
    time.sleep(seconds)
    idle_cpu = (time.process_time() - cpu) / seconds
    print(f"{label:<40} main-thread loop {median(samples):6.2f} us per put+get; "
          f"process CPU while the main thread sleeps: {idle_cpu:.2f} cores", flush=True)
    return {"loop_us": median(samples), "idle_cores": idle_cpu}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=1.0)
    args = p.parse_args(argv)
    import torch

    from dsv4_idxk_probe.testbed.builtin.transport import NixlEndpoint

    measure("no NIXL agent", args.seconds)
    endpoint = NixlEndpoint("progress-bench", [torch.zeros((256, 4096), dtype=torch.uint8)])
    try:
        measure("NIXL agent, UCX, progress thread on", args.seconds)
    finally:
        endpoint.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
