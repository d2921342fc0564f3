"""Digest kernel on a GPU: exactness against the reference, then speed.

One run measures, in order:
  1. exactness: kernel vs NumPy reference on fresh random data, every
     shipped layout, ragged rooms, device memory and pinned host memory;
  2. the ceiling: device-to-device copy bandwidth (bytes read + written);
  3. a torch gather of the same rows (what a naive digest would at least cost);
  4. our kernel on one large room (43 layers x 1024 pages) for 8448 B and
     16384 B rows, over a sweep of block sizes and warps;
  5. 64 short rooms (16 pages x 43 layers) in one launch: GPU time per room;
  6. caller-thread CPU time per room of DigestEngine.submit, with
     torch.cuda.set_sync_debug_mode("error") on (any sync raises).

Usage (needs CUDA; no sglang):  python bench/digest_gpu.py [--out DIR]
Prints a table last; writes digest_gpu.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, get_layout  # noqa: E402
from dsv4_idxk_probe.digest.kernel import DigestKernel  # noqa: E402
from dsv4_idxk_probe.digest.room_table import plan_cells  # noqa: E402

N_LAYERS = 43


def median_ms(fn, warmup=25, rep=200) -> float:
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def random_pool(layout, n_layers, n_pages, device, pin=False):
    bufs = []
    for _ in range(n_layers):
        t = torch.randint(0, 256, (n_pages, layout.row_bytes), dtype=torch.uint8, device="cpu" if pin else device)
        bufs.append(t.pin_memory() if pin else t)
    return bufs


# %% 1. exactness


def check_exactness(device) -> list[dict]:
    results = []
    rng = np.random.default_rng(int(time.time()))
    for name in ("fp8", "fp4", "bf16"):
        layout = get_layout(name)
        for pinned in (False, True):
            bufs = random_pool(layout, N_LAYERS, 40, device, pin=pinned)
            layer_ids = sorted(rng.choice(61, N_LAYERS, replace=False).tolist())
            kernel = DigestEngine(layout, layer_ids, bufs, backend="triton", device=device)
            reference = DigestEngine(layout, layer_ids, [b.cpu() for b in bufs], backend="reference")
            rooms = []
            for i in range(12):
                n_pages = int(rng.integers(0, 9))
                n_tokens = int(rng.integers(max(0, (n_pages - 1) * 256 + 1), n_pages * 256 + 1)) if n_pages else 0
                pages = rng.choice(40, n_pages, replace=False)
                if i % 3 != 2:  # page tables on the device as int64 and int32, and on the host
                    pages = torch.tensor(pages, dtype=torch.int64 if i % 3 == 0 else torch.int32, device=device)
                rooms.append(RoomRequest(f"{name}-{i}", pages, n_tokens))
            got, want = kernel.digest_now(rooms), reference.digest_now(rooms)
            same = all(
                np.array_equal(a.layer_segment, b.layer_segment) and np.array_equal(a.pages, b.pages) for a, b in zip(got, want)
            )
            results.append({"layout": name, "memory": "pinned host" if pinned else "device", "rooms": len(rooms), "exact": same})
    return results


# %% 2-4. bandwidth


def copy_bandwidth(device) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    n = 2 << 30
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3)


class Launch:
    """The kernel with device-resident tables for `rooms`, launched again and again."""

    def __init__(self, layout, bufs, rooms, device, block=128, rows=1, warps=4):
        self.plan = plan_cells(rooms, len(bufs))
        self.table = torch.tensor(
            [[r.pages.data_ptr(), r.pages.element_size(), r.n_pages, r.n_tokens, first]
             for r, first in zip(rooms, self.plan.first_cells)], dtype=torch.int64, device=device)
        self.layers = torch.tensor([[b.data_ptr(), i] for i, b in enumerate(bufs)], dtype=torch.int64, device=device)
        self.segments = torch.tensor([[s.word_offset, s.slot_words] for s in layout.segments], dtype=torch.int32, device=device)
        self.cells = torch.empty((self.plan.n_cells, len(layout.segments)), dtype=torch.int64, device=device)
        self.layout, self.rooms = layout, rooms
        self.tune(block, rows, warps)

    def tune(self, block, rows, warps):
        self.kernel = DigestKernel(self.layers.data_ptr(), self.layers.shape[0], self.segments.data_ptr(), self.layout,
                                   block=block, rows=rows, num_warps=warps)

    def __call__(self):
        self.kernel.launch(self.table.data_ptr(), self.cells.data_ptr(), len(self.rooms), self.plan.max_pages)


def bench_large_room(name, device, copy_bps) -> dict:
    layout = get_layout(name)
    n_pages = 1024
    bufs = random_pool(layout, N_LAYERS, n_pages + 64, device)
    pages = torch.randperm(bufs[0].shape[0], device=device)[:n_pages].contiguous()
    launch = Launch(layout, bufs, [RoomRequest("big", pages, n_pages * 256)], device)
    read_bytes = N_LAYERS * n_pages * layout.row_bytes

    def gather():
        for b in bufs:
            b.index_select(0, pages)

    gather_ms = median_ms(gather)
    sweep = []
    for rows_per_program in (1, 2, 4, 8):
        for block in (128, 256, 512):
            for warps in (4, 8):
                launch.tune(block, rows_per_program, warps)
                ms = median_ms(launch, rep=100)
                sweep.append(
                    {"rows": rows_per_program, "block": block, "warps": warps, "ms": ms,
                     "read_TBps": read_bytes / (ms * 1e-3) / 1e12}
                )
    best = min(sweep, key=lambda r: r["ms"])
    return {
        "layout": name,
        "row_bytes": layout.row_bytes,
        "bytes_read": read_bytes,
        "gather_ms": gather_ms,
        "gather_TBps_rw": 2 * read_bytes / (gather_ms * 1e-3) / 1e12,
        "best": best,
        "ratio_to_copy": best["read_TBps"] * 1e12 / copy_bps,
        "sweep": sweep,
    }


# %% 5-6. short rooms and enqueue cost


def short_rooms(device, block, rows_per_program, warps) -> dict:
    layout = get_layout("fp8")
    n_rooms, n_pages = 64, 16
    bufs = random_pool(layout, N_LAYERS, n_rooms * n_pages + 64, device)
    perm = torch.randperm(bufs[0].shape[0], device=device)
    rooms = [RoomRequest(f"s{i}", perm[i * n_pages : (i + 1) * n_pages].contiguous(), n_pages * 256 - 37) for i in range(n_rooms)]
    kernel_ms = median_ms(Launch(layout, bufs, rooms, device, block, rows_per_program, warps))

    engine = DigestEngine(layout, list(range(N_LAYERS)), bufs, block=block, rows=rows_per_program)
    engine.digest_now(rooms)  # warm-up: compile, pinned pools
    engine.digest_now(rooms[:1])
    done = []
    iters = 50
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    syncs_ok = True
    try:
        t_wall, t_cpu = time.perf_counter(), time.thread_time()
        for _ in range(iters):
            engine.submit(rooms, done.append)
        t_cpu = time.thread_time() - t_cpu
        t_wall = time.perf_counter() - t_wall
        # single-room submits, as a hook that cannot batch would do, once the
        # batched results above are collected (steady state: pinned buffers reused)
        deadline = time.monotonic() + 30
        while len(done) < iters and time.monotonic() < deadline:
            time.sleep(0.001)
        t1 = time.thread_time()
        for r in rooms:
            engine.submit([r], done.append)
        t1 = time.thread_time() - t1
    except RuntimeError as exc:
        syncs_ok = False
        t_cpu = t_wall = t1 = float("nan")
        print("SYNC DETECTED:", exc)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    engine.close()
    return {
        "rooms": n_rooms,
        "pages": n_pages,
        "layers": N_LAYERS,
        "kernel_us_per_room": kernel_ms * 1e3 / n_rooms,
        "enqueue_cpu_us_per_room_batched": t_cpu * 1e6 / (iters * n_rooms),
        "enqueue_wall_us_per_room_batched": t_wall * 1e6 / (iters * n_rooms),
        "enqueue_cpu_us_per_room_single": t1 * 1e6 / n_rooms,
        "zero_syncs": syncs_ok,
        "batches_delivered": len(done),
        "staging_allocations": engine._staging.allocations,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    device = torch.device("cuda")
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    report["exactness"] = check_exactness(device)
    copy_bps = copy_bandwidth(device)
    report["copy_TBps_rw"] = copy_bps / 1e12
    report["large_room"] = [bench_large_room(n, device, copy_bps) for n in ("fp8", "bf16")]
    best = report["large_room"][0]["best"]
    report["short_rooms"] = short_rooms(device, best["block"], best["rows"], best["warps"])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "digest_gpu.json").write_text(json.dumps(report, indent=1))

    print(f"\n{report['date']}  {report['device']}  torch {report['torch']}  triton {report['triton']}")
    print("exactness:", ", ".join(f"{r['layout']}/{r['memory']}={'OK' if r['exact'] else 'FAIL'}" for r in report["exactness"]))
    print(f"copy (read+write): {report['copy_TBps_rw']:.2f} TB/s")
    for r in report["large_room"]:
        b = r["best"]
        print(
            f"large room {r['layout']} ({r['row_bytes']} B rows, {r['bytes_read']/1e6:.0f} MB): "
            f"kernel {b['ms']*1e3:.0f} us = {b['read_TBps']:.2f} TB/s read (rows {b['rows']}, block {b['block']}, warps {b['warps']}), "
            f"ratio to copy {r['ratio_to_copy']:.2f}; torch gather {r['gather_ms']*1e3:.0f} us ({r['gather_TBps_rw']:.2f} TB/s r+w)"
        )
    s = report["short_rooms"]
    print(
        f"64 short rooms (16 pages x 43 layers) in one launch: {s['kernel_us_per_room']:.2f} us GPU/room; "
        f"enqueue CPU {s['enqueue_cpu_us_per_room_batched']:.1f} us/room batched, "
        f"{s['enqueue_cpu_us_per_room_single']:.1f} us/room single; zero syncs: {s['zero_syncs']}"
    )
    ok = all(r["exact"] for r in report["exactness"]) and s["zero_syncs"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
