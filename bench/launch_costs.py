"""What each CUDA call a digest submit could make costs the caller's thread.

Why: a submit's cost on the scheduler thread is a handful of driver calls plus
Python. Before choosing how a submit talks to the GPU (upload a table or let
the kernel read it from pinned host memory; download results or let the
kernel store them into pinned host memory), measure each call on the machine
itself. Also checks that a kernel can read a table from pinned host memory
and store into pinned host memory through plain addresses (the zero-copy
path), and that the stores are visible once an event after it completes.

With `--nixl`, everything is measured again while the process also holds a
NIXL agent (UCX backend, progress thread on, as the rig and SGLang's NIXL
connector create it, two agents connected and one WRITE done between VRAM
buffers): inside the rig's processes the same calls cost 3-8x more, and the
agents' spinning progress threads were the first suspect. They are not: with
the agents, every call costs the same or less (bench/RESULTS.md, 12:52-13:35
UTC entry); the gap before a call is what makes it dearer (submit_profile).

Usage (CUDA):  python3 -m bench.launch_costs [--calls 2000] [--nixl] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench import harness


@triton.jit
def _tensor_args(a_ptr, b_ptr, c_ptr, n):
    i = tl.arange(0, 16)
    tl.store(c_ptr + i, tl.load(a_ptr + i) + tl.load(b_ptr + i), mask=i < n)


@triton.jit(do_not_specialize=["a", "b", "c", "n"])
def _address_args(a, b, c, n):
    """Reads two int64 vectors and stores their sum, all through plain addresses."""
    i = tl.arange(0, 16)
    a_ptr = a.to(tl.pointer_type(tl.int64))
    b_ptr = b.to(tl.pointer_type(tl.int64))
    c_ptr = c.to(tl.pointer_type(tl.int64))
    tl.store(c_ptr + i, tl.load(a_ptr + i) + tl.load(b_ptr + i), mask=i < n)


def per_call_us(fn, calls: int) -> float:
    """Median of 20 chunks of `calls // 20` calls each, in microseconds per call."""
    us = harness.per_call_us(fn, calls, chunks=20)
    torch.cuda.synchronize()
    return us


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--nixl", action="store_true", help="measure again with a NIXL agent in the process")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    pinned_a = torch.arange(16, dtype=torch.int64).pin_memory()
    pinned_b = torch.full((16,), 100, dtype=torch.int64).pin_memory()
    pinned_c = torch.zeros(16, dtype=torch.int64).pin_memory()
    dev_a, dev_b, dev_c = (t.to(dev) for t in (pinned_a, pinned_b, pinned_c))
    staging = torch.zeros(4096, dtype=torch.uint8).pin_memory()
    device_staging = torch.empty(4096, dtype=torch.uint8, device=dev)
    event = torch.cuda.Event()

    # Zero-copy check: the kernel reads pinned host memory and stores into it.
    _address_args[(1,)](pinned_a.data_ptr(), pinned_b.data_ptr(), pinned_c.data_ptr(), 16)
    event.record()
    while not event.query():
        time.sleep(1e-4)
    zero_copy_ok = bool(torch.equal(pinned_c, pinned_a + pinned_b))
    _tensor_args[(1,)](dev_a, dev_b, dev_c, 16)
    torch.cuda.synchronize()

    a, b, c = pinned_a.data_ptr(), pinned_b.data_ptr(), pinned_c.data_ptr()
    cases = {
        "event record": event.record,
        "event query": event.query,
        "current stream": torch.cuda.current_stream,
        "H2D copy 4 KB (pinned, non_blocking)": lambda: device_staging.copy_(staging, non_blocking=True),
        "D2H copy 4 KB (into pinned, non_blocking)": lambda: staging.copy_(device_staging, non_blocking=True),
        "torch.empty 4 KB on device": lambda: torch.empty(4096, dtype=torch.uint8, device=dev),
        "tensor slice + view": lambda: staging[256:1024].view(torch.int64),
        "Triton launch, 3 tensor args": lambda: _tensor_args[(1,)](dev_a, dev_b, dev_c, 16),
        "Triton launch, 4 int args (pinned addresses)": lambda: _address_args[(1,)](a, b, c, 16),
        "Triton launch, 3-D grid, 4 int args": lambda: _address_args[(1, 1, 1)](a, b, c, 16),
    }
    costs = {name: per_call_us(fn, args.calls) for name, fn in cases.items()}
    with_nixl = None
    if args.nixl:
        from dsv4_idxk_probe.testbed.builtin.transport import NixlEndpoint

        # Two agents, connected and one WRITE done between their VRAM buffers, as
        # in the rig: UCX opens its CUDA transports only once a peer is connected.
        endpoint = NixlEndpoint("launch-costs", [torch.zeros((256, 4096), dtype=torch.uint8, device=dev)])
        sender = NixlEndpoint("launch-costs-peer", [torch.ones((256, 4096), dtype=torch.uint8, device=dev)])
        try:
            peer = sender.connect(endpoint.metadata())
            sender.wait(sender.write_rows(peer, [(0, 3, 7)], b"warm"))
            endpoint.wait_notification(b"warm")
            time.sleep(0.5)  # the progress threads are running
            with_nixl = {name: per_call_us(fn, args.calls) for name, fn in cases.items()}
        finally:
            sender.close()
            endpoint.close()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "calls": args.calls, "zero_copy_ok": zero_copy_ok, "us_per_call": costs,
              "us_per_call_with_nixl_agent": with_nixl}
    for name, us in costs.items():
        print(f"{name:48s} {us:8.2f} us" + (f"   with a NIXL agent {with_nixl[name]:8.2f} us" if with_nixl else ""))
    print(f"zero-copy (kernel reads and stores pinned host memory through addresses): {'ok' if zero_copy_ok else 'WRONG'}")
    if args.out:
        harness.write_result(args.out, "launch_costs.json", report, indent=2)
    return 0 if zero_copy_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
