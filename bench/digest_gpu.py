"""Digest kernel on a GPU: exactness against the reference, then speed beside same-run ceilings.

One run measures, in order:
  1. exactness: the engine (kernel) vs the NumPy reference on fresh random data,
     every shipped layout, ragged rooms, device memory and pinned host memory,
     page tables on the device (int64, int32) and on the host, out-of-range page
     ids among them (flagged and counted the same way, never read);
  2. the ceilings: a device-to-device copy (bytes read + written); a tuned
     read-only kernel that sums the 32-bit words of one contiguous 2 GiB buffer
     (and of a buffer as large as each layout's digest); a read-only kernel that
     sums the words of the same gathered rows the digest reads;
  3. the digest of one large room (43 layers x 1024 pages) for fp8, fp4 and bf16
     rows over a sweep of rows per program and warps, each
     point checked exact on a sample of its cells; ratios to each ceiling;
  4. 64 short rooms (16 pages x 43 layers, fp8) in one launch: GPU time per room,
     beside the launch floor (an empty Triton kernel, and the digest kernel on a
     room with no pages);
  5. caller-thread CPU time per room of DigestEngine.submit, with
     torch.cuda.set_sync_debug_mode("error") on (any sync raises), and the CPU
     time of an empty kernel's launch.

Usage:  python bench/digest_gpu.py [--out DIR]
        python bench/digest_gpu.py --precompile-only   (fill Triton's cache, 16 processes)
        python bench/digest_gpu.py --profile-one fp8 --shapes 1x1,1x4   (for ncu)
        python bench/digest_gpu.py --smoke      (no GPU: the interpreter, tiny sizes)
Prints a table last; writes digest_gpu.json under --out. `--precompile-only` first
spares the lease a minute of one-at-a-time compiles: the run then loads each
kernel from Triton's cache.
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

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.testing  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, get_layout  # noqa: E402
from dsv4_idxk_probe.digest import reference as ref  # noqa: E402
from dsv4_idxk_probe.digest.engine import kernel_shape  # noqa: E402
from dsv4_idxk_probe.digest.kernel import DigestKernel, _digest_rooms_kernel, layer_table, layout_constants  # noqa: E402
from dsv4_idxk_probe.digest.room_table import plan_cells  # noqa: E402

LAYOUTS = ("fp8", "fp4", "bf16")
SWEEP = [(rows, warps) for rows in (1, 2, 4) for warps in (1, 2, 4, 8)]


def sweep_for(layout, sweep) -> list[tuple]:
    """The sweep's points whose threads hold at most 72 words of the tile (more spill)."""
    return [(r, w) for r, w in sweep if r * layout.row_bytes // 4 <= 72 * 32 * w]


class Sizes:
    """Problem sizes: the issue's on a GPU, tiny under the interpreter (--smoke)."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.layers = 3 if smoke else 43
        self.pages = 8 if smoke else 1024
        self.short_rooms, self.short_pages = (4, 2) if smoke else (64, 16)
        self.contiguous_bytes = (1 << 20) if smoke else (2 << 30)
        self.sample_pages = 4 if smoke else 32
        self.sweep = [(1, 2), (2, 4)] if smoke else SWEEP


def median_ms(fn, warmup=25, rep=100) -> float:
    """Median of event-timed calls, each after an L2 flush (Triton's do_bench); on the
    CPU (--smoke), one timed call."""
    if not torch.cuda.is_available():
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def random_pool(layout, n_layers, n_pages, device, pin=False):
    bufs = []
    for _ in range(n_layers):
        t = torch.randint(0, 256, (n_pages, layout.row_bytes), dtype=torch.uint8, device="cpu" if pin else device)
        bufs.append(t.pin_memory() if pin else t)
    return bufs


# %% 1. exactness


def check_exactness(device, sizes) -> list[dict]:
    """The engine's digests and out-of-range counts equal the reference backend's."""
    results = []
    rng = np.random.default_rng(int(time.time()))
    pool_pages = 40
    for name in LAYOUTS:
        layout = get_layout(name)
        for pinned in (False, True) if device.type == "cuda" else (False,):
            bufs = random_pool(layout, sizes.layers, pool_pages, device, pin=pinned)
            layer_ids = sorted(rng.choice(61, sizes.layers, replace=False).tolist())
            engines = {
                "kernel": DigestEngine(layout, layer_ids, bufs, backend="triton", device=device),
                "reference": DigestEngine(layout, layer_ids, [b.cpu() for b in bufs], backend="reference"),
            }
            rooms = []
            for i in range(12):
                n_pages = int(rng.integers(0, 9))
                n_tokens = int(rng.integers(max(0, (n_pages - 1) * 256 + 1), n_pages * 256 + 1)) if n_pages else 0
                pages = rng.choice(pool_pages, n_pages, replace=False)
                if i % 4 == 3 and n_pages:  # out-of-range ids: past the end, and negative
                    pages[rng.integers(0, n_pages)] = pool_pages + int(rng.integers(0, 1 << 20))
                    pages[rng.integers(0, n_pages)] = -int(rng.integers(1, 1 << 20))
                if i % 3 != 2:  # page tables on the device as int64 and int32, and on the host
                    pages = torch.tensor(pages, dtype=torch.int64 if i % 3 == 0 else torch.int32, device=device)
                rooms.append(RoomRequest(f"{name}-{i}", pages, n_tokens))
            got = {}
            for which, engine in engines.items():
                batches = []
                engine.submit(rooms, batches.append)
                engine.close()
                got[which] = batches[0]
            k, r = got["kernel"], got["reference"]
            same = k.out_of_range == r.out_of_range and all(
                np.array_equal(a.layer_segment, b.layer_segment) and np.array_equal(a.pages, b.pages)
                for a, b in zip(k.digests, r.digests, strict=True))
            results.append({"layout": name, "memory": "pinned host" if pinned else "device", "rooms": len(rooms),
                            "out_of_range_rows": sum(k.out_of_range), "exact": same})
    return results


# %% 2. ceilings


@triton.jit
def _contiguous_sum(src, out, BLOCK: tl.constexpr):
    """Sum BLOCK consecutive 32-bit words per program: a pure read at the memory's rate."""
    pid = tl.program_id(0).to(tl.int64)
    words = tl.load(src + pid * BLOCK + tl.arange(0, BLOCK))
    tl.store(out + pid, tl.sum(words, axis=0))


@triton.jit
def _gathered_sum(layer_table, pages, out, n_pages, ROW_WORDS: tl.constexpr, HEAD: tl.constexpr,
                  TAIL: tl.constexpr, BASE_ALIGN: tl.constexpr, ROWS: tl.constexpr):
    """Sum the words of each (layer, page) row found through a page table, as the digest
    finds them (the same layer table): the same reads, no hashing."""
    layer = tl.program_id(0).to(tl.int64)
    logical = tl.program_id(1).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    valid = logical < n_pages
    physical = tl.load(pages + tl.minimum(logical, n_pages - 1))
    distance = tl.load(layer_table + layer * 3)
    base = layer_table.to(tl.pointer_type(tl.uint32)) + (distance // BASE_ALIGN) * (BASE_ALIGN // 4)
    rows = base + physical * ROW_WORDS
    total = tl.sum(tl.load(rows[:, None] + tl.arange(0, HEAD)[None, :]), axis=1)
    if TAIL > 0:
        total += tl.sum(tl.load(rows[:, None] + HEAD + tl.arange(0, TAIL)[None, :]), axis=1)
    tl.store(out + layer * n_pages + logical, total, mask=valid)


@triton.jit
def _empty_kernel(x):
    pass


def copy_bandwidth(device, nbytes) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def contiguous_read(device, nbytes, configs) -> dict:
    """The fastest contiguous read-only sum over `nbytes` (a sweep of words per program
    and warps): bytes read per second, and every point of the sweep."""
    words = torch.randint(-(1 << 31), 1 << 31, (nbytes // 4,), dtype=torch.int32, device=device).view(torch.uint32)
    sweep = []
    for block, warps in configs:
        out = torch.empty(words.numel() // block, dtype=torch.uint32, device=device)
        grid = (words.numel() // block,)
        ms = median_ms(lambda: _contiguous_sum[grid](words, out, BLOCK=block, num_warps=warps))
        sweep.append({"block": block, "warps": warps, "ms": ms, "read_TBps": nbytes / (ms * 1e-3) / 1e12})
    best = max(sweep, key=lambda r: r["read_TBps"])
    return {"bytes": nbytes, "best": best, "sweep": sweep}


def gathered_read(layout, bufs, table, base_align, pages, device) -> dict:
    """The fastest read-only sum over the digest's own gathered rows."""
    row_words = layout.row_bytes // 4
    head = 1 << (row_words.bit_length() - 1)
    tail = row_words - head
    if tail & (tail - 1):
        return {"skipped": f"row of {row_words} words is not two powers of two"}
    n_pages = pages.numel()
    out = torch.empty(len(bufs) * n_pages, dtype=torch.uint32, device=device)
    sweep = []
    for rows in (1, 2):
        for warps in (4, 8):
            grid = (len(bufs), -(-n_pages // rows))
            ms = median_ms(lambda: _gathered_sum[grid](table, pages, out, n_pages, ROW_WORDS=row_words, HEAD=head,
                                                        TAIL=tail, BASE_ALIGN=base_align, ROWS=rows, num_warps=warps))
            read = len(bufs) * n_pages * layout.row_bytes
            sweep.append({"rows": rows, "warps": warps, "ms": ms, "read_TBps": read / (ms * 1e-3) / 1e12})
    return {"best": max(sweep, key=lambda r: r["read_TBps"]), "sweep": sweep}


# %% 3. the digest of one large room


class Launch:
    """The kernel with device-resident tables for `rooms`, launched again and again."""

    def __init__(self, layout, bufs, rooms, device, rows=1, warps=4):
        self.plan = plan_cells(rooms, len(bufs))
        self.table = torch.tensor(
            [[r.pages.data_ptr(), r.pages.element_size(), r.n_pages, r.n_tokens, first]
             for r, first in zip(rooms, self.plan.first_cells)], dtype=torch.int64, device=device)
        self.layers, self.base_align = layer_table(bufs, list(range(len(bufs))), device)
        self.cells = torch.empty((self.plan.n_cells, len(layout.segments)), dtype=torch.int64, device=device)
        self.contents = torch.empty_like(self.cells)
        self.flags = torch.empty(self.plan.n_cells, dtype=torch.uint8, device=device)
        self.layout, self.rooms, self.bufs = layout, rooms, bufs
        self.tune(rows, warps)

    def tune(self, rows, warps):
        self.kernel = DigestKernel(self.layers, len(self.bufs), self.layout, rows=rows, num_warps=warps,
                                   base_align=self.base_align)

    def __call__(self):
        self.kernel.launch(self.table.data_ptr(), self.cells.data_ptr(), self.contents.data_ptr(), self.flags.data_ptr(),
                           len(self.rooms), self.plan.max_pages)

    def sample_reference(self, rng, n_sample):
        """(room slot, logical pages, reference cells [layers, pages, segments], their
        content digests) for a random sample of each room's pages: what every tuning
        must store."""
        samples = []
        for slot, room in enumerate(self.rooms):
            logical = np.sort(rng.choice(room.n_pages, min(n_sample, room.n_pages), replace=False))
            if room.n_pages - 1 not in logical:  # the last page: a tail page in the short rooms
                logical[-1] = room.n_pages - 1
            physical = room.pages.cpu().numpy()[logical]
            cells = np.zeros((len(self.bufs), len(logical), len(self.layout.segments)), dtype=np.uint64)
            contents = np.zeros_like(cells)
            frozen = np.array([self.layout.frozen_slots(room.n_tokens, int(k)) for k in logical])
            for li, buf in enumerate(self.bufs):
                rows = buf[torch.as_tensor(physical, device=buf.device)].cpu().numpy()
                contents[li] = ref.segment_digests(rows, frozen, self.layout)
                cells[li] = ref.cell_contributions(contents[li], [li] * len(logical), logical)
            samples.append((slot, logical, cells, contents))
        return samples

    def exact_on(self, samples) -> bool:
        cells = self.cells.cpu().numpy().view(np.uint64)
        contents = self.contents.cpu().numpy().view(np.uint64)
        flags = self.flags.cpu().numpy()
        for slot, logical, want, want_contents in samples:
            if not np.array_equal(self.plan.block(cells, slot)[:, logical], want):
                return False
            if not np.array_equal(self.plan.block(contents, slot)[:, logical], want_contents):
                return False
        return not flags.any()


def bench_large_room(name, device, sizes, ceilings, rng) -> dict:
    layout = get_layout(name)
    bufs = random_pool(layout, sizes.layers, sizes.pages + 64, device)
    pages = torch.randperm(bufs[0].shape[0], device=device)[: sizes.pages].contiguous()
    launch = Launch(layout, bufs, [RoomRequest("big", pages, sizes.pages * 256)], device)
    read_bytes = sizes.layers * sizes.pages * layout.row_bytes
    samples = launch.sample_reference(rng, sizes.sample_pages)
    gathered = gathered_read(layout, bufs, launch.layers, launch.base_align, pages, device)
    same_size = contiguous_read(device, read_bytes, [(ceilings["best_block"], ceilings["best_warps"])])
    sweep = []
    for rows, warps in sweep_for(layout, sizes.sweep):
        launch.tune(rows, warps)
        launch.cells.fill_(0x5A5A)
        launch.contents.fill_(0x5A5A)
        ms = median_ms(launch)
        sweep.append({"rows": rows, "warps": warps, "ms": ms,
                      "read_TBps": read_bytes / (ms * 1e-3) / 1e12, "exact": launch.exact_on(samples)})
    best = max(sweep, key=lambda r: r["read_TBps"])
    shape = kernel_shape(layout)
    default = next((r for r in sweep if (r["rows"], r["warps"]) == (shape["rows"], shape["num_warps"])), None)
    tbps = best["read_TBps"] * 1e12
    return {
        "layout": name, "row_bytes": layout.row_bytes, "bytes_read": read_bytes, "best": best, "engine_default": default,
        "gathered_read": gathered, "contiguous_same_size": same_size,
        "ratio_to_contiguous": tbps / ceilings["contiguous_Bps"],
        "ratio_to_contiguous_same_size": tbps / (same_size["best"]["read_TBps"] * 1e12),
        "ratio_to_gathered": tbps / (gathered["best"]["read_TBps"] * 1e12) if "best" in gathered else None,
        "ratio_to_copy": tbps / ceilings["copy_Bps"],
        "all_exact": all(r["exact"] for r in sweep),
        "sweep": sweep,
    }


# %% 4-5. short rooms, launch floor, enqueue cost


def launch_floor(device) -> dict:
    """An empty Triton kernel: GPU time per launch (event-timed, back to back) and the
    caller's CPU time per launch through the JIT entry point and the C launcher."""
    if device.type != "cuda":
        return {}
    x = torch.empty(1, device=device)
    compiled = _empty_kernel[(1,)](x)
    gpu_ms = median_ms(lambda: _empty_kernel[(1,)](x))
    torch.cuda.synchronize()
    n = 2000
    t = time.thread_time()
    for _ in range(n):
        _empty_kernel[(1,)](x)
    jit_us = (time.thread_time() - t) * 1e6 / n
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream().cuda_stream
    t = time.thread_time()
    for _ in range(n):
        compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, x)
    direct_us = (time.thread_time() - t) * 1e6 / n
    torch.cuda.synchronize()
    return {"empty_kernel_gpu_us": gpu_ms * 1e3, "empty_kernel_cpu_us_jit": jit_us, "empty_kernel_cpu_us_direct": direct_us}


def short_rooms(device, sizes, shape, rng) -> dict:
    layout = get_layout("fp8")
    n_rooms, n_pages = sizes.short_rooms, sizes.short_pages
    bufs = random_pool(layout, sizes.layers, n_rooms * n_pages + 64, device)
    perm = torch.randperm(bufs[0].shape[0], device=device)
    rooms = [RoomRequest(f"s{i}", perm[i * n_pages : (i + 1) * n_pages].contiguous(), n_pages * 256 - 37)
             for i in range(n_rooms)]
    launch = Launch(layout, bufs, rooms, device, shape["rows"], shape["num_warps"])
    samples = launch.sample_reference(rng, 2)
    kernel_ms = median_ms(launch)
    exact = launch.exact_on(samples)
    no_pages = torch.tensor([[perm.data_ptr(), 8, 0, 0, 0]], dtype=torch.int64, device=device)  # every program returns
    empty_ms = median_ms(lambda: launch.kernel.launch(no_pages.data_ptr(), launch.cells.data_ptr(),
                                                      launch.contents.data_ptr(), launch.flags.data_ptr(), 1, 1))
    result = {"rooms": n_rooms, "pages": n_pages, "layers": sizes.layers, "shape": shape, "exact": exact,
              "kernel_us": kernel_ms * 1e3, "kernel_us_per_room": kernel_ms * 1e3 / n_rooms,
              "read_TBps": n_rooms * n_pages * sizes.layers * layout.row_bytes / (kernel_ms * 1e-3) / 1e12,
              "digest_kernel_no_pages_gpu_us": empty_ms * 1e3}
    if device.type != "cuda":
        return result

    engine = DigestEngine(layout, list(range(sizes.layers)), bufs)
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
    result.update({
        "enqueue_cpu_us_per_room_batched": t_cpu * 1e6 / (iters * n_rooms),
        "enqueue_wall_us_per_room_batched": t_wall * 1e6 / (iters * n_rooms),
        "enqueue_cpu_us_per_room_single": t1 * 1e6 / n_rooms,
        "zero_syncs": syncs_ok,
        "batches_delivered": len(done),
        "staging_allocations": engine._staging.allocations,
    })
    return result


def profile_one(name, device, sizes, shapes) -> None:
    """Two launches of each (rows, warps) shape on the large room, for Nsight
    Compute (run under `ncu -k regex:_digest_rooms_kernel`)."""
    layout = get_layout(name)
    bufs = random_pool(layout, sizes.layers, sizes.pages + 64, device)
    pages = torch.randperm(bufs[0].shape[0], device=device)[: sizes.pages].contiguous()
    launch = Launch(layout, bufs, [RoomRequest("big", pages, sizes.pages * 256)], device)
    for rows, warps in shapes:
        launch.tune(rows, warps)
        launch()
        launch()
    torch.cuda.synchronize()


def _compile_jobs(sizes) -> list[tuple]:
    jobs = [("digest", name, rows, warps) for name in LAYOUTS for rows, warps in sweep_for(get_layout(name), sizes.sweep)]
    jobs += [("contiguous", block, warps) for block in (2048, 4096, 8192, 16384) for warps in (4, 8, 16)]
    jobs += [("gathered", name, rows, warps) for name in LAYOUTS for rows in (1, 2) for warps in (4, 8)]
    return jobs


def _compile_one(job) -> str:
    """Compile one kernel the run will launch, with the same specialisation, into
    Triton's cache (warmup compiles without launching)."""
    try:
        device = "cuda"
        if job[0] == "digest":
            _, name, rows, warps = job
            layout = get_layout(name)
            table, align = layer_table([torch.empty((1, layout.row_bytes), dtype=torch.uint8, device=device)], [0], device)
            address = 1 << 40  # an address-sized integer: the run passes int64 addresses
            _digest_rooms_kernel.warmup(address, table, address, address, **layout_constants(layout, align), ROWS=rows,
                                        num_warps=warps, grid=(1,))
        elif job[0] == "contiguous":
            _, block, warps = job
            words = torch.empty(block, dtype=torch.uint32, device=device)
            _contiguous_sum.warmup(words, words, BLOCK=block, num_warps=warps, grid=(1,))
        else:
            _, name, rows, warps = job
            layout = get_layout(name)
            row_words = layout.row_bytes // 4
            head = 1 << (row_words.bit_length() - 1)
            table, align = layer_table([torch.empty((1, layout.row_bytes), dtype=torch.uint8, device=device)], [0], device)
            pages = torch.zeros(16, dtype=torch.int64, device=device)
            out = torch.empty(16, dtype=torch.uint32, device=device)
            _gathered_sum.warmup(table, pages, out, 1024, ROW_WORDS=row_words, HEAD=head, TAIL=row_words - head,
                                 BASE_ALIGN=align, ROWS=rows, num_warps=warps, grid=(1,))
        return "ok"
    except Exception as exc:  # the run compiles it itself then
        return f"{job}: {type(exc).__name__}: {exc}"


def precompile(sizes) -> None:
    import concurrent.futures
    import multiprocessing

    jobs = _compile_jobs(sizes)
    t = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 1), mp_context=context) as pool:
        outcomes = list(pool.map(_compile_one, jobs))
    failed = [o for o in outcomes if o != "ok"]
    print(f"precompiled {len(jobs) - len(failed)}/{len(jobs)} kernels in {time.perf_counter() - t:.0f} s", *failed[:5],
          sep="\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true", help="no GPU: the interpreter, tiny sizes")
    parser.add_argument("--profile-one", choices=LAYOUTS, help="only launch --shapes twice each (for ncu)")
    parser.add_argument("--shapes", default="1x1", help="rows x warps, comma separated")
    parser.add_argument("--precompile-only", action="store_true")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    sizes = Sizes(args.smoke)
    if args.precompile_only:
        precompile(sizes)
        return 0
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.profile_one:
        shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
        profile_one(args.profile_one, device, sizes, shapes)
        return 0
    rng = np.random.default_rng(int(time.time()))
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
    }
    t0 = time.perf_counter()
    report["exactness"] = check_exactness(device, sizes)
    print("exactness:", report["exactness"], f"({time.perf_counter() - t0:.0f} s)", flush=True)
    copy_bps = copy_bandwidth(device, sizes.contiguous_bytes)
    configs = [(b, w) for b in (2048, 4096, 8192, 16384) for w in (4, 8, 16)] if not sizes.smoke else [(1024, 4)]
    contiguous = contiguous_read(device, sizes.contiguous_bytes, configs)
    report["ceilings"] = {"copy_TBps_rw": copy_bps / 1e12, "contiguous_read": contiguous}
    ceilings = {"copy_Bps": copy_bps, "contiguous_Bps": contiguous["best"]["read_TBps"] * 1e12,
                "best_block": contiguous["best"]["block"], "best_warps": contiguous["best"]["warps"]}
    print(f"ceilings: copy {copy_bps / 1e12:.2f} TB/s r+w, contiguous read {contiguous['best']} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    report["large_room"] = []
    for name in args.layouts.split(","):
        report["large_room"].append(bench_large_room(name, device, sizes, ceilings, rng))
        r = report["large_room"][-1]
        print(f"{name}: best {r['best']} ratio {r['ratio_to_contiguous']:.3f} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    report["launch_floor"] = launch_floor(device)
    report["short_rooms"] = short_rooms(device, sizes, kernel_shape(get_layout("fp8")), rng)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "digest_gpu.json").write_text(json.dumps(report, indent=1))

    print(f"\n{report['date']}  {report['device']}  torch {report['torch']}  triton {report['triton']}")
    print("exactness:", ", ".join(f"{r['layout']}/{r['memory']}={'OK' if r['exact'] else 'FAIL'}"
                                  f" ({r['out_of_range_rows']} rows out of range)" for r in report["exactness"]))
    c = report["ceilings"]
    print(f"ceilings: copy {c['copy_TBps_rw']:.2f} TB/s (read+write); contiguous read "
          f"{c['contiguous_read']['best']['read_TBps']:.2f} TB/s (block {c['contiguous_read']['best']['block']}, "
          f"warps {c['contiguous_read']['best']['warps']})")
    for r in report["large_room"]:
        b, g, s = r["best"], r["gathered_read"].get("best"), r["contiguous_same_size"]["best"]
        d = r["engine_default"]
        print(f"{r['layout']} ({r['row_bytes']} B rows, {r['bytes_read'] / 1e6:.0f} MB): digest {b['ms'] * 1e3:.1f} us = "
              f"{b['read_TBps']:.2f} TB/s (rows {b['rows']}, warps {b['warps']}; sweep exact: "
              f"{r['all_exact']}); ratio to contiguous {r['ratio_to_contiguous']:.3f}, to same-size contiguous "
              f"{r['ratio_to_contiguous_same_size']:.3f} ({s['read_TBps']:.2f}), to gathered "
              f"{(r['ratio_to_gathered'] or 0):.3f} ({(g or {}).get('read_TBps', 0):.2f}), to copy {r['ratio_to_copy']:.3f}"
              + (f"; engine default {d['read_TBps']:.2f} TB/s" if d else ""))
    s, f = report["short_rooms"], report["launch_floor"]
    print(f"{s['rooms']} short rooms ({s['pages']} pages x {s['layers']} layers) in one launch: {s['kernel_us']:.1f} us, "
          f"{s['kernel_us_per_room']:.2f} us GPU/room ({s['read_TBps']:.2f} TB/s, exact {s['exact']}); digest kernel on "
          f"a room with no pages {s['digest_kernel_no_pages_gpu_us']:.1f} us")
    if f:
        print(f"launch floor: empty Triton kernel {f['empty_kernel_gpu_us']:.1f} us GPU, "
              f"{f['empty_kernel_cpu_us_jit']:.1f} us CPU (JIT), {f['empty_kernel_cpu_us_direct']:.1f} us CPU (C launcher)")
    if "zero_syncs" in s:
        print(f"enqueue CPU {s['enqueue_cpu_us_per_room_batched']:.1f} us/room batched, "
              f"{s['enqueue_cpu_us_per_room_single']:.1f} us/room single; zero syncs: {s['zero_syncs']}")
    ok = (all(r["exact"] for r in report["exactness"]) and all(r["all_exact"] for r in report["large_room"])
          and s["exact"] and s.get("zero_syncs", True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
