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
     rows over a sweep of rows per program and warps, each point checked exact
     on a sample of its cells and contents; ratios to each ceiling. Where the
     GPU has programmatic dependent launches (compute capability 9+; the
     engine's default there), every sweep point and every tiling of the
     contiguous ceiling is timed both plain and as a dependent launch;
  4. 64 short rooms (16 pages x 43 layers, fp8) in one launch: GPU time per room,
     beside the launch floor (an empty Triton kernel, and the digest kernel on a
     room with no pages);
  5. caller-thread CPU time per room of DigestEngine.submit, with
     torch.cuda.set_sync_debug_mode("error") on (any sync raises), and the CPU
     time of an empty kernel's launch.

Usage:  python -m bench.digest_gpu [--out DIR]
        python -m bench.digest_gpu --precompile-only   (fill Triton's cache, 16 processes)
        python -m bench.digest_gpu --profile-one fp8 --shapes 1x1,1x4   (for ncu)
        python -m bench.digest_gpu --smoke      (no GPU: the interpreter, tiny sizes)
        python -m bench.digest_gpu --layouts fp4 --sweep 1x1 --methods steady   (a quick look)
Every ceiling and every digest is timed by each of three methods (`METHODS`), and
each ratio divides numbers of one method: "steady" (the headline: back-to-back
launches rotating over two copies of the inputs, per-launch time of the run),
"flush_read" (each launch alone, after a read of a clean 256 MiB buffer evicts
L2) and "flush_write" (Triton's do_bench: each launch after zeroing 256 MiB, whose
dirty lines L2 writes back while the timed kernel runs).
Prints a table last; writes digest_gpu.json under --out. `--precompile-only` first
spares the lease a minute of one-at-a-time compiles: the run then loads each
kernel from Triton's cache.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import datetime, timezone

import numpy as np
import torch

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.testing  # noqa: E402
from triton.language.extra.cuda import gdc_wait  # noqa: E402

from bench.harness import write_result  # noqa: E402
from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, get_layout  # noqa: E402
from dsv4_idxk_probe.digest import reference as ref  # noqa: E402
from dsv4_idxk_probe.digest.launch import fold_words, kernel_shape  # noqa: E402
from dsv4_idxk_probe.digest.kernel import (DigestKernel, _digest_rooms_kernel, dependent_launches_on,  # noqa: E402
                                           layer_table, layout_constants)
from dsv4_idxk_probe.digest.room_table import plan_cells  # noqa: E402

LAYOUTS = ("fp8", "fp4", "bf16")
FOLD_SHAPES = ((1, 1), (2, 1), (2, 2), (4, 2), (1, 4), (2, 4))  # rows per program x warps, the folding kernel
SWEEP = [(rows, warps) for rows in (1, 2, 4) for warps in (1, 2, 4)]  # rows per program x warps
METHODS = ("steady", "flush_read", "flush_write")
POLICIES = ("", "evict_first")  # the loads' eviction policy: Triton's default, or lines evicted first
# The contiguous ceiling's tilings: words per program x warps x eviction policy.
CONTIGUOUS_CONFIGS = [(b, w, p, False) for b in (2048, 4096, 8192, 16384) for w in (4, 8, 16) for p in POLICIES]
# The gathered read's tilings: rows per program x warps x grid order (page block fastest?) x policy.
GATHERED_CONFIGS = [(r, w, m, p) for r, w in ((1, 1), (1, 2), (1, 4), (2, 1), (1, 8)) for m in (False, True)
                    for p in POLICIES]


def sweep_for(layout, sweep) -> list[tuple]:
    """The sweep's points whose threads hold at most 136 words of the tile (more spill)."""
    return [(r, w) for r, w in sweep if r * layout.row_bytes // 4 <= 136 * 32 * w]


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
        self.pdl = (False,)  # where the GPU has them: every sweep point also as a programmatic dependent launch


class Timer:
    """Milliseconds per call of `fns` (callables doing the same work on distinct
    inputs, rotated), by one of `METHODS`; every ceiling and digest goes through
    the same three, so each ratio compares like with like.

    - steady: `calls` launches back to back between two events, rotating over
      `fns` (two copies of the inputs, each far larger than L2, so no launch finds
      the last one's data there); median over `reps` of the time per launch. Each
      kernel still starts and drains on its own (a stream runs them one after
      another); only the host's launch latency is hidden.
    - flush_read: each call alone, event-timed, after a read-only sum over a clean
      256 MiB buffer has evicted L2 (no dirty line left to write back); median.
    - flush_write: Triton's do_bench (each call after zeroing a 256 MiB buffer); median.
    On the CPU (--smoke) every method is one timed call of each input.
    """

    def __init__(self, device, smoke):
        self.cuda = device.type == "cuda"
        n = (256 << 20) // 4 if not smoke else 1024
        self.flush_words = torch.randint(-(1 << 31), 1 << 31, (n,), dtype=torch.int32, device=device).view(torch.uint32)
        self.flush_out = torch.empty(n // 16384 or 1, dtype=torch.uint32, device=device)

    def _flush_read(self):
        block = 16384 if self.flush_words.numel() >= 16384 else self.flush_words.numel()
        _contiguous_sum[(self.flush_words.numel() // block,)](self.flush_words, self.flush_out, BLOCK=block, POLICY="",
                                                              PDL=False, num_warps=8)

    def ms(self, method, fns, calls=20, reps=7, warmup=3) -> float:
        fns = fns if isinstance(fns, (list, tuple)) else [fns]
        if not self.cuda:  # each input once (so each stores its outputs), timed
            t = time.perf_counter()
            for fn in fns:
                fn()
            return (time.perf_counter() - t) * 1e3 / len(fns)
        if method == "flush_write":
            return float(triton.testing.do_bench(fns[0], warmup=25, rep=100, return_mode="median"))
        for i in range(warmup * len(fns)):
            fns[i % len(fns)]()
        if method == "steady":
            times = []
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                self._flush_read()  # ~60 us of GPU work: the launches below queue up behind it
                start.record()
                for i in range(calls):
                    fns[i % len(fns)]()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / calls)
            return float(np.median(times))
        if method == "flush_read":
            events = []
            for i in range(calls * 2):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                self._flush_read()
                start.record()
                fns[i % len(fns)]()
                end.record()
                events.append((start, end))
            torch.cuda.synchronize()
            return float(np.median([a.elapsed_time(b) for a, b in events]))
        raise ValueError(method)

    def all(self, fns, **kw) -> dict:
        """{method: ms} for every method."""
        return {m: self.ms(m, fns, **kw) for m in METHODS}


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
                for a, b in zip(k.digests, r.digests, strict=True)) and all(
                np.array_equal(a, b) for a, b in zip(k.contents, r.contents, strict=True))
            results.append({"layout": name, "memory": "pinned host" if pinned else "device", "rooms": len(rooms),
                            "out_of_range_rows": sum(k.out_of_range), "exact": same})
    return results


# %% 2. ceilings


@triton.jit
def _contiguous_sum(src, out, BLOCK: tl.constexpr, POLICY: tl.constexpr, PDL: tl.constexpr):
    """Sum BLOCK consecutive 32-bit words per program: a pure read at the memory's rate.
    POLICY: the loads' eviction policy ("" or "evict_first"); PDL: launched as a
    programmatic dependent launch, as the digest is where the GPU has them, so the
    ceiling gets the same early start after the kernel before it."""
    if PDL:
        gdc_wait()
    pid = tl.program_id(0).to(tl.int64)
    words = tl.load(src + pid * BLOCK + tl.arange(0, BLOCK), eviction_policy=POLICY)
    tl.store(out + pid, tl.sum(words, axis=0))


@triton.jit
def _gathered_sum(layer_table, pages, out, n_pages, ROW_WORDS: tl.constexpr, HEAD: tl.constexpr,
                  TAIL: tl.constexpr, BASE_ALIGN: tl.constexpr, ROWS: tl.constexpr, PAGE_MAJOR: tl.constexpr,
                  POLICY: tl.constexpr):
    """Sum the words of each (layer, page) row found through a page table, as the digest
    finds them (the same layer table): the same reads, no hashing. PAGE_MAJOR: the grid
    is (page block, layer), else (layer, page block); POLICY: the loads' eviction policy."""
    if PAGE_MAJOR:
        block, layer = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    else:
        layer, block = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    logical = block * ROWS + tl.arange(0, ROWS)
    valid = logical < n_pages
    physical = tl.load(pages + tl.minimum(logical, n_pages - 1))
    distance = tl.load(layer_table + layer * 3)
    base = layer_table.to(tl.pointer_type(tl.uint32)) + (distance // BASE_ALIGN) * (BASE_ALIGN // 4)
    rows = base + physical * ROW_WORDS
    total = tl.sum(tl.load(rows[:, None] + tl.arange(0, HEAD)[None, :], eviction_policy=POLICY), axis=1)
    if TAIL > 0:
        total += tl.sum(tl.load(rows[:, None] + HEAD + tl.arange(0, TAIL)[None, :], eviction_policy=POLICY), axis=1)
    tl.store(out + layer * n_pages + logical, total, mask=valid)


@triton.jit
def _empty_kernel(x):
    pass


def _best(sweep, nbytes) -> dict:
    """Per method: the sweep's fastest point, as {"point", "ms", "read_TBps"}."""
    best = {}
    for m in METHODS:
        point = min(sweep, key=lambda r: r["ms"][m])
        best[m] = {"point": {k: v for k, v in point.items() if k not in ("ms", "exact")}, "ms": point["ms"][m],
                   "read_TBps": nbytes / (point["ms"][m] * 1e-3) / 1e12}
    return best


def copy_bandwidth(timer, device, nbytes) -> dict:
    """Bytes read + written per second by a large device-to-device copy, per method."""
    pairs = []
    for _ in range(2):
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        pairs.append((src, torch.empty_like(src)))
    ms = timer.all([lambda s=s, d=d: d.copy_(s) for s, d in pairs], calls=10, reps=5)
    return {m: 2 * nbytes / (ms[m] * 1e-3) / 1e12 for m in METHODS}


def contiguous_read(timer, device, nbytes, configs) -> dict:
    """The fastest contiguous read-only sum over `nbytes` (a sweep of words per program,
    warps and eviction policy), per method: two buffers, which the steady method rotates over."""
    copies = [torch.randint(-(1 << 31), 1 << 31, (nbytes // 4,), dtype=torch.int32, device=device).view(torch.uint32)
              for _ in range(2)]
    sweep = []
    for block, warps, policy, pdl in configs:
        grid = (copies[0].numel() // block,)
        out = torch.empty(grid[0], dtype=torch.uint32, device=device)
        fns = [lambda w=w: _contiguous_sum[grid](w, out, BLOCK=block, POLICY=policy, PDL=pdl, num_warps=warps,
                                                 **({"launch_pdl": True} if pdl else {})) for w in copies]
        sweep.append({"block": block, "warps": warps, "policy": policy, "pdl": pdl,
                      "ms": timer.all(fns, calls=max(4, min(40, (8 << 30) // nbytes)))})
    del copies
    return {"bytes": nbytes, "best": _best(sweep, nbytes), "sweep": sweep}


def gathered_read(timer, layout, bufs, table, base_align, page_tables, device) -> dict:
    """The fastest read-only sum over the digest's own gathered rows, per method (two
    page tables over disjoint pages, which the steady method rotates over)."""
    row_words = layout.row_bytes // 4
    head = 1 << (row_words.bit_length() - 1)
    tail = row_words - head
    if tail & (tail - 1):
        return {"skipped": f"row of {row_words} words is not two powers of two"}
    n_pages = page_tables[0].numel()
    out = torch.empty(len(bufs) * n_pages, dtype=torch.uint32, device=device)
    read = len(bufs) * n_pages * layout.row_bytes
    sweep = []
    for rows, warps, page_major, policy in GATHERED_CONFIGS:
        blocks = -(-n_pages // rows)
        grid = (blocks, len(bufs)) if page_major else (len(bufs), blocks)
        fns = [lambda pages=pages: _gathered_sum[grid](table, pages, out, n_pages, ROW_WORDS=row_words, HEAD=head,
                                                       TAIL=tail, BASE_ALIGN=base_align, ROWS=rows,
                                                       PAGE_MAJOR=page_major, POLICY=policy, num_warps=warps)
               for pages in page_tables]
        sweep.append({"rows": rows, "warps": warps, "page_major": page_major, "policy": policy, "ms": timer.all(fns)})
    return {"best": _best(sweep, read), "sweep": sweep}


# %% 3. the digest of one large room


class Launch:
    """The kernel on `rooms`, launched again and again: a room alone passed by value, as
    the engine passes it (`by_value`), the room table and the outputs in device memory,
    or in pinned host memory, where the engine's first design kept them (`pinned`)."""

    def __init__(self, layout, bufs, rooms, device, rows=1, warps=4, by_value=True, pinned=False, contents=True,
                 pdl=False, fold=False):
        self.plan = plan_cells(rooms, len(bufs))
        self.store_contents = contents  # the kernel stores content digests (the engine: with diagnosis)
        self.fold = fold  # the kernel adds its cells into the room's folds (the engine's way; `cells` holds them)
        pinned = pinned and device.type == "cuda"
        where = {"device": "cpu", "pin_memory": True} if pinned else {"device": device}
        table = torch.tensor([[r.pages.data_ptr(), r.pages.element_size(), r.n_pages, r.n_tokens, first]
                              for r, first in zip(rooms, self.plan.first_cells)], dtype=torch.int64)
        self.table = table.pin_memory() if pinned else table.to(device)
        self.one_room = None
        if by_value and len(rooms) == 1:
            r = rooms[0]
            self.one_room = (r.pages.data_ptr(), r.pages.element_size(), r.n_pages, r.n_tokens)
        self.layers, self.base_align = layer_table(bufs, list(range(len(bufs))), device)
        self.cells = torch.empty((self.plan.n_cells, len(layout.segments)), dtype=torch.int64, **where)
        self.contents = torch.empty((self.plan.n_cells, len(layout.segments)), dtype=torch.int64, **where)
        self.flags = torch.empty(self.plan.n_cells, dtype=torch.uint8, **where)
        self.layout, self.rooms, self.bufs = layout, rooms, bufs
        self.tune(rows, warps, pdl)

    def tune(self, rows, warps, pdl=False):
        self.kernel = DigestKernel(self.layers, len(self.bufs), self.layout, rows=rows, num_warps=warps,
                                   base_align=self.base_align, contents=self.store_contents, pdl=pdl, fold=self.fold)

    def __call__(self):
        self.kernel.launch(self.table.data_ptr(), self.cells.data_ptr(), self.contents.data_ptr(), self.flags.data_ptr(),
                           len(self.rooms), self.plan.max_pages, one_room=self.one_room)

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
            if self.store_contents and not np.array_equal(self.plan.block(contents, slot)[:, logical], want_contents):
                return False
        return not flags.any()


def bench_large_room(timer, name, device, sizes, ceilings, rng) -> dict:
    """One room of `sizes.layers` x `sizes.pages`, and a second over other pages of the
    same pool (the steady method rotates over the two)."""
    layout = get_layout(name)
    bufs = random_pool(layout, sizes.layers, 2 * sizes.pages + 64, device)
    perm = torch.randperm(bufs[0].shape[0], device=device)
    page_tables = [perm[i * sizes.pages : (i + 1) * sizes.pages].contiguous() for i in range(2)]
    launches = [Launch(layout, bufs, [RoomRequest(f"big{i}", p, sizes.pages * 256)], device) for i, p in enumerate(page_tables)]
    read_bytes = sizes.layers * sizes.pages * layout.row_bytes
    samples = [launch.sample_reference(rng, sizes.sample_pages) for launch in launches]
    gathered = gathered_read(timer, layout, bufs, launches[0].layers, launches[0].base_align, page_tables, device)
    same_size = contiguous_read(timer, device, read_bytes, ceilings["contiguous_configs"])
    sweep = []
    for (rows, warps), pdl in ((shape, pdl) for shape in sweep_for(layout, sizes.sweep) for pdl in sizes.pdl):
        for launch in launches:
            launch.tune(rows, warps, pdl)
            launch.cells.fill_(0x5A5A)
            launch.contents.fill_(0x5A5A)
        ms = timer.all(launches)
        sweep.append({"rows": rows, "warps": warps, "pdl": pdl, "ms": ms,
                      "exact": all(launch.exact_on(sample) for launch, sample in zip(launches, samples))})
    best = _best(sweep, read_bytes)
    shape = kernel_shape(layout)
    engine_pdl = True in sizes.pdl  # the engine's "auto": dependent launches where the GPU has them
    # The engine's shape without content digests stored (prefill, and decode with diagnosis off).
    bare = [Launch(layout, bufs, launch.rooms, device, shape["rows"], shape["num_warps"], contents=False, pdl=engine_pdl)
            for launch in launches]
    for launch in bare:
        launch.cells.fill_(0x5A5A)
    bare_ms = timer.all(bare)
    no_contents = {"ms": bare_ms, "read_TBps": {m: read_bytes / (ms * 1e-3) / 1e12 for m, ms in bare_ms.items()},
                   "exact": all(launch.exact_on(sample) for launch, sample in zip(bare, samples))}
    engine_path = engine_submits(timer, layout, bufs, page_tables, device, sizes, shape, read_bytes)
    default = next((r for r in sweep if (r["rows"], r["warps"], r["pdl"]) == (shape["rows"], shape["num_warps"], engine_pdl)),
                   None)
    if engine_path:  # the engine's whole GPU time per room (kernel, copies) against the same-run 2 GiB read
        ceiling = ceilings["contiguous"]["flush_read"]["read_TBps"]
        steady_ceiling = ceilings["contiguous"]["steady"]["read_TBps"]
        for tag in ENGINE_FORMS:
            engine_path[f"engine_ratio{tag}"] = engine_path[f"engine_read_TBps{tag}"] / ceiling
            engine_path[f"engine_steady_ratio{tag}"] = engine_path[f"engine_steady_read_TBps{tag}"] / steady_ceiling
    ratios = {}
    for m in METHODS:
        tbps = best[m]["read_TBps"]
        ratios[m] = {"contiguous": tbps / ceilings["contiguous"][m]["read_TBps"],
                     "contiguous_same_size": tbps / same_size["best"][m]["read_TBps"],
                     "gathered": tbps / gathered["best"][m]["read_TBps"] if "best" in gathered else None,
                     "copy": tbps / ceilings["copy_TBps"][m]}
    return {
        "layout": name, "row_bytes": layout.row_bytes, "bytes_read": read_bytes, "best": best,
        "engine_default": default and {m: read_bytes / (default["ms"][m] * 1e-3) / 1e12 for m in METHODS},
        "gathered_read": gathered, "contiguous_same_size": same_size, "ratios": ratios, "engine_path": engine_path,
        "no_contents": no_contents, "no_contents_ratio": {m: no_contents["read_TBps"][m] / ceilings["contiguous"][m]["read_TBps"]
                                                          for m in METHODS},
        "all_exact": all(r["exact"] for r in sweep) and no_contents["exact"], "sweep": sweep,
    }


def engine_submits(timer, layout, bufs, page_tables, device, sizes, shape, read_bytes) -> dict:
    """GPU time of the room as the engine digests it: `DigestEngine.submit`, the room by
    value, each submit timed alone after a read flush (its outputs stored into the staging
    buffer's device twin, then copied down); beside the kernel storing its cells straight
    into pinned host memory (a `Launch` with its table and outputs in pinned memory, the
    engine's first design), and into device memory (the sweep). Why: stores to pinned
    memory cross PCIe as small writes (bench/RESULTS.md, issue 21)."""
    if device.type != "cuda":
        return {}
    rooms = [RoomRequest(f"e{i}", p, sizes.pages * 256) for i, p in enumerate(page_tables)]
    result = {}
    forms = tuple(ENGINE_FORMS)
    for tag, (ms, steady_ms, dropped) in engine_gpu_ms_forms(timer, layout, bufs, [[r] for r in rooms],
                                                            forms=forms).items():
        result.update({f"engine_submit_us{tag}": ms * 1e3, f"engine_read_TBps{tag}": read_bytes / (ms * 1e-3) / 1e12,
                       f"engine_steady_us{tag}": steady_ms * 1e3,
                       f"engine_steady_read_TBps{tag}": read_bytes / (steady_ms * 1e-3) / 1e12,
                       f"engine_dropped_batches{tag}": dropped})
    for tag, (ms, steady_ms, _) in engine_gpu_ms_forms(timer, layout, bufs, [[r] for r in rooms], fold=False).items():
        result[f"cells_engine_submit_us{tag}"] = ms * 1e3
        result[f"cells_engine_steady_us{tag}"] = steady_ms * 1e3
    # What the engine adds to the kernel on the serving stream, split: the device fold's atomics
    # (the kernel folding, against storing its cells) and the batch's event recorded behind each
    # launch (which may keep the next dependent launch from starting early), back to back.
    pdl = dependent_launches_on(device)
    for tag, fold in (("cells", False), ("fold", True)):
        bare = [Launch(layout, bufs, [r], device, shape["rows"], shape["num_warps"], pdl=pdl, fold=fold) for r in rooms]
        for launch in bare:
            launch.cells.zero_()
        events = [torch.cuda.Event() for _ in bare]
        evented = [lambda launch=launch, event=event: (launch(), event.record()) for launch, event in zip(bare, events)]
        result[f"kernel_{tag}_steady_us"] = timer.ms("steady", bare) * 1e3
        result[f"kernel_{tag}_event_steady_us"] = timer.ms("steady", evented) * 1e3
    # The folding kernel at other shapes (rows per program x warps): more rows per program,
    # fewer (layer, segment) atomics per row; the engine's shape was chosen storing cells.
    folding = {}
    for rows, warps in FOLD_SHAPES:
        shaped = [Launch(layout, bufs, [r], device, rows, warps, pdl=pdl, fold=True) for r in rooms]
        for launch in shaped:
            launch.cells.zero_()
        folding[f"{rows}x{warps}"] = timer.ms("steady", shaped) * 1e3
    result["kernel_fold_steady_us_by_shape"] = folding
    # Decode's copy down, which its collector makes on its own stream (the copy engine), timed alone:
    # the folds, the flags and the contents of one room.
    n_cells, n_seg = sizes.layers * sizes.pages, len(layout.segments)
    down = 8 * (fold_words([sizes.pages], sizes.layers, n_seg) + ((n_cells + 7) >> 3) + n_cells * n_seg)
    twin, host = torch.zeros(down, dtype=torch.uint8, device=device), torch.empty(down, dtype=torch.uint8, pin_memory=True)
    result["decode_copy_down_bytes"] = down
    result["decode_copy_down_us"] = timer.ms("flush_read", [lambda: host.copy_(twin, non_blocking=True)]) * 1e3
    pinned = [Launch(layout, bufs, [r], device, shape["rows"], shape["num_warps"], pinned=True) for r in rooms]
    pinned_ms = timer.ms("flush_read", pinned)
    result.update({"pinned_outputs_us": pinned_ms * 1e3, "pinned_outputs_read_TBps": read_bytes / (pinned_ms * 1e-3) / 1e12})
    # A room of a serving size (64 pages, 16k tokens), the same three ways.
    # What the collector adds on its own stream after each batch, where the kernel folds on the
    # device: zeroing the bytes of the twin the batch wrote (tables, folds, flags, contents).
    for tag, contents in (("", True), ("_no_contents", False)):
        used = (8 * (32 + fold_words([sizes.pages], sizes.layers, n_seg)) + 8 * (-(-n_cells // 8))
                + (8 * n_cells * n_seg if contents else 0))
        twin = torch.ones(used, dtype=torch.uint8, device=device)
        result[f"zeroing_bytes{tag}"] = used
        result[f"zeroing_us{tag}"] = timer.ms("flush_read", [twin.zero_]) * 1e3
    medium = [RoomRequest(f"m{i}", p[:64].contiguous(), 64 * 256) for i, p in enumerate(page_tables)]
    for tag, (ms, steady_ms, _) in engine_gpu_ms_forms(timer, layout, bufs, [[r] for r in medium]).items():
        result[f"medium_engine_us{tag}"] = ms * 1e3
        result[f"medium_engine_steady_us{tag}"] = steady_ms * 1e3
    launches = [Launch(layout, bufs, [r], device, shape["rows"], shape["num_warps"], pinned=pin) for r in medium
                for pin in (True, False)]
    result["medium_pinned_outputs_us"] = timer.ms("flush_read", launches[0::2]) * 1e3
    result["medium_device_outputs_us"] = timer.ms("flush_read", launches[1::2]) * 1e3
    return result


def _role_form(role: str) -> dict:
    """`role`'s engine options as the probe config gives them (`DigestEngine.role_options`,
    diagnosis on), with the collector's deferral at 0, as every engine figure of
    bench/RESULTS.md was measured (the shipped 3 ms moves the collector's copies down and
    zeroing later, off the measured submits; not measured)."""
    from dsv4_idxk_probe.config import parse_config

    return {**DigestEngine.role_options(parse_config({}), role), "defer_s": 0.0}


ENGINE_FORMS = {  # tag -> engine options: how each side's engine copies its outputs down
    "": {**_role_form("decode"), "download": "submit"},  # contents copied down at the submit, on the serving stream
    "_no_contents": _role_form("prefill"),  # prefill's form (no contents; the copy at the submit, its in-band slot)
    "_decode": _role_form("decode"),  # decode's form (diagnosis on; its collector copies down)
}


def engine_gpu_ms_forms(timer, layout, bufs, batches, fold: bool = True, forms=("", "_no_contents")) -> dict:
    """`engine_gpu_ms` of an engine of each of `forms` (`ENGINE_FORMS`): one that copies
    contents down at the submit (diagnosis on; key ""), one that copies no contents
    (prefill's; "_no_contents"), decode's (its collector copies the outputs down on a
    stream of its own once the kernel is done, so the serving stream carries the kernel
    alone; "_decode"); `fold` False: its kernel stores the cells for the collector to fold
    (the engine before the device fold)."""
    return {tag: engine_gpu_ms(timer, DigestEngine(layout, list(range(len(bufs))), bufs, fold=fold, **ENGINE_FORMS[tag]),
                               batches)
            for tag in forms}


def engine_gpu_ms(timer, engine, batches, reps: int = 20, steady_calls: int = 20) -> tuple[float, float, int]:
    """GPU milliseconds per `engine.submit` of each batch, two ways, and the batches the
    engine dropped. flush_read: each submit alone after a read flush, from its first
    device call to its event, median of `reps`. steady (the bench's headline method, as
    the ceilings' steady): `steady_calls` submits back to back, rotating over the
    batches, per-submit time between two events, median of 7 runs after one that fills
    the staging pool (a pinned allocation mid-run would wait for the GPU). Either way a
    GPU sleep queued before the start event keeps the submits' own host time (tens of us
    a room) out of the measure: the GPU reaches the start only once they are all queued."""
    engine.digest_now(batches[0])
    steady_ms = float("nan")
    if timer.cuda:
        times = []
        for i in range(reps):
            timer._flush_read()
            torch.cuda._sleep(8_000_000)  # ~4 ms at 2 GHz, far more than a submit's host time
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            engine.submit(batches[i % len(batches)], lambda _: None)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        ms = float(np.median(times))
        runs = []
        for run in range(8):
            _drain(engine)
            timer._flush_read()
            torch.cuda._sleep(8_000_000 + 2_000_000 * steady_calls // 20)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(steady_calls):
                engine.submit(batches[i % len(batches)], lambda _: None)
            end.record()
            end.synchronize()
            if run:  # the first run fills the staging pool
                runs.append(start.elapsed_time(end) / steady_calls)
        steady_ms = float(np.median(runs))
    else:
        ms = timer.ms("flush_read", [lambda b=b: engine.submit(b, lambda _: None) for b in batches])
    _drain(engine)
    engine.close()
    return ms, steady_ms, engine.stats.dropped_batches


def _drain(engine, timeout_s: float = 30.0) -> None:
    """Wait until the collector has delivered every submitted room (its buffers back in their pool)."""
    deadline = time.monotonic() + timeout_s
    while engine.stats.completed_rooms < engine.stats.submitted_rooms and time.monotonic() < deadline:
        time.sleep(0.01)


# %% 4-5. short rooms, launch floor, enqueue cost


def launch_floor(timer, device) -> dict:
    """An empty Triton kernel: GPU time per launch (per method; steady: back to back)
    and the caller's CPU time per launch through the JIT entry point and the C launcher."""
    if device.type != "cuda":
        return {}
    x = torch.empty(1, device=device)
    compiled = _empty_kernel[(1,)](x)
    stream = torch.cuda.current_stream().cuda_stream
    direct = lambda: compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, x)  # noqa: E731
    gpu_us = {m: ms * 1e3 for m, ms in timer.all(direct).items()}
    torch.cuda.synchronize()
    n = 2000
    t = time.thread_time()
    for _ in range(n):
        _empty_kernel[(1,)](x)
    jit_us = (time.thread_time() - t) * 1e6 / n
    torch.cuda.synchronize()
    t = time.thread_time()
    for _ in range(n):
        compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, x)
    direct_us = (time.thread_time() - t) * 1e6 / n
    torch.cuda.synchronize()
    return {"empty_kernel_gpu_us": gpu_us, "empty_kernel_cpu_us_jit": jit_us, "empty_kernel_cpu_us_direct": direct_us}


def short_rooms(timer, device, sizes, shape, rng) -> dict:
    """`sizes.short_rooms` rooms in one launch, per method; two such batches over
    disjoint pages of one pool, which the steady method rotates over."""
    layout = get_layout("fp8")
    n_rooms, n_pages = sizes.short_rooms, sizes.short_pages
    bufs = random_pool(layout, sizes.layers, 2 * n_rooms * n_pages + 64, device)
    perm = torch.randperm(bufs[0].shape[0], device=device)
    batches = [[RoomRequest(f"s{i}", perm[i * n_pages : (i + 1) * n_pages].contiguous(), n_pages * 256 - 37)
                for i in range(k * n_rooms, (k + 1) * n_rooms)] for k in range(2)]
    rooms = batches[0]
    launches = [Launch(layout, bufs, batch, device, shape["rows"], shape["num_warps"]) for batch in batches]
    samples = [launch.sample_reference(rng, 2) for launch in launches]
    kernel_ms = timer.all(launches)
    exact = all(launch.exact_on(sample) for launch, sample in zip(launches, samples))
    launch = launches[0]
    no_pages = torch.tensor([[perm.data_ptr(), 8, 0, 0, 0]], dtype=torch.int64, device=device)  # every program returns
    empty_ms = timer.all(lambda: launch.kernel.launch(no_pages.data_ptr(), launch.cells.data_ptr(),
                                                      launch.contents.data_ptr(), launch.flags.data_ptr(), 1, 1,
                                                      one_room=(perm.data_ptr(), 8, 0, 0)))
    read = n_rooms * n_pages * sizes.layers * layout.row_bytes
    result = {"rooms": n_rooms, "pages": n_pages, "layers": sizes.layers, "shape": shape, "exact": exact,
              "kernel_us": {m: ms * 1e3 for m, ms in kernel_ms.items()},
              "kernel_us_per_room": {m: ms * 1e3 / n_rooms for m, ms in kernel_ms.items()},
              "read_TBps": {m: read / (ms * 1e-3) / 1e12 for m, ms in kernel_ms.items()},
              "digest_kernel_no_pages_gpu_us": {m: ms * 1e3 for m, ms in empty_ms.items()}}
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
    # The engine's GPU time per room, copies included (with contents copied down, and without),
    # beside the kernel storing its outputs straight into pinned host memory (the first design).
    for tag, (ms, steady_ms, _) in engine_gpu_ms_forms(timer, layout, bufs, batches).items():
        result[f"engine_gpu_us_per_room{tag}"] = ms * 1e3 / n_rooms
        result[f"engine_steady_gpu_us_per_room{tag}"] = steady_ms * 1e3 / n_rooms
    pinned = [Launch(layout, bufs, batch, device, shape["rows"], shape["num_warps"], pinned=True) for batch in batches]
    result["pinned_outputs_us_per_room"] = timer.ms("flush_read", pinned) * 1e3 / n_rooms
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
    """Two launches of each (rows, warps) shape on the large room, then a
    contiguous read of the same bytes and of 2 GiB (16384 words per program, 8 warps),
    for Nsight Compute (run under `ncu -k regex:"_digest_rooms_kernel|_contiguous_sum"`):
    kernel times without any host-side timing."""
    layout = get_layout(name)
    bufs = random_pool(layout, sizes.layers, sizes.pages + 64, device)
    pages = torch.randperm(bufs[0].shape[0], device=device)[: sizes.pages].contiguous()
    launch = Launch(layout, bufs, [RoomRequest("big", pages, sizes.pages * 256)], device)
    for shape in shapes:
        launch.tune(*shape)
        launch()
        launch()
    del bufs, launch
    for nbytes in (sizes.layers * sizes.pages * layout.row_bytes, sizes.contiguous_bytes):
        words = torch.empty(nbytes // 4 // 16384 * 16384, dtype=torch.uint32, device=device)
        out = torch.empty(words.numel() // 16384, dtype=torch.uint32, device=device)
        _contiguous_sum[(out.numel(),)](words, out, BLOCK=16384, POLICY="", PDL=False, num_warps=8)
        del words, out
    torch.cuda.synchronize()


def _compile_jobs(sizes) -> list[tuple]:
    shapes = {(name, r, w) for name in LAYOUTS for r, w in sweep_for(get_layout(name), sizes.sweep)}
    jobs = [("digest", *shape, one_room, True, pdl, False) for shape in sorted(shapes) for one_room in (False, True)
            for pdl in sizes.pdl]
    defaults = {(name, kernel_shape(get_layout(name))["rows"], kernel_shape(get_layout(name))["num_warps"]) for name in LAYOUTS}
    # the engine's own launches at its shape: with and without contents, folding on the device or not
    jobs += [("digest", *shape, one_room, contents, pdl, fold) for shape in sorted(defaults) for one_room in (False, True)
             for pdl in sizes.pdl for contents, fold in ((False, False), (False, True), (True, True))]
    jobs += [("contiguous", *config[:3], pdl) for config in CONTIGUOUS_CONFIGS for pdl in sizes.pdl]
    jobs += [("gathered", name, *config) for name in LAYOUTS for config in GATHERED_CONFIGS]
    return jobs


def _compile_one(job) -> str:
    """Compile one kernel the run will launch, with the same specialisation, into
    Triton's cache (warmup compiles without launching)."""
    try:
        device = "cuda"
        if job[0] == "digest":
            _, name, rows, warps, one_room, contents, pdl, fold = job
            layout = get_layout(name)
            table, align = layer_table([torch.empty((1, layout.row_bytes), dtype=torch.uint8, device=device)], [0], device)
            address = 1 << 40  # an address-sized integer: the run passes int64 addresses
            # the by-value fields as a launch passes them: a room's, or four zeros (ints typed
            # by value: an address is i64, a zero i32, so each variant needs its own)
            by_value = (address, 8, 1024, 1 << 18) if one_room else (0, 0, 0, 0)
            _digest_rooms_kernel.warmup(address, table, address, address, address, *by_value,
                                        **layout_constants(layout, align), ROWS=rows, ID_STRIDE=1,
                                        ONE_ROOM=one_room, CONTENTS=contents, FOLD=fold, PDL=pdl, num_warps=warps,
                                        grid=(1,),
                                        **({"launch_pdl": True} if pdl else {}))
        elif job[0] == "contiguous":
            _, block, warps, policy, pdl = job
            words = torch.empty(block, dtype=torch.uint32, device=device)
            _contiguous_sum.warmup(words, words, BLOCK=block, POLICY=policy, PDL=pdl, num_warps=warps, grid=(1,),
                                   **({"launch_pdl": True} if pdl else {}))
        else:
            _, name, rows, warps, page_major, policy = job
            layout = get_layout(name)
            row_words = layout.row_bytes // 4
            head = 1 << (row_words.bit_length() - 1)
            table, align = layer_table([torch.empty((1, layout.row_bytes), dtype=torch.uint8, device=device)], [0], device)
            pages = torch.zeros(16, dtype=torch.int64, device=device)
            out = torch.empty(16, dtype=torch.uint32, device=device)
            _gathered_sum.warmup(table, pages, out, 1024, ROW_WORDS=row_words, HEAD=head, TAIL=row_words - head,
                                 BASE_ALIGN=align, ROWS=rows, PAGE_MAJOR=page_major, POLICY=policy, num_warps=warps,
                                 grid=(1,))
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
    global METHODS  # --methods: the timing methods every measurement uses
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true", help="no GPU: the interpreter, tiny sizes")
    parser.add_argument("--profile-one", choices=LAYOUTS, help="only launch --shapes twice each (for ncu)")
    parser.add_argument("--shapes", default="1x1", help="rows x warps, comma separated")
    parser.add_argument("--precompile-only", action="store_true")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--sweep", help="rows x warps of the large room's sweep, comma separated (default: all)")
    parser.add_argument("--methods", default=",".join(METHODS), help="timing methods, comma separated")
    parser.add_argument("--no-pdl", action="store_true",
                        help="time the kernel and the ceiling as plain launches only (the engine's submits keep its default)")
    args = parser.parse_args()
    METHODS = tuple(m for m in args.methods.split(",") if m in METHODS)
    sizes = Sizes(args.smoke)
    if args.sweep:
        sizes.sweep = [tuple(int(v) for v in shape.split("x")) for shape in args.sweep.split(",")]
    if not (args.smoke or args.no_pdl or torch.cuda.get_device_capability()[0] < 9):
        sizes.pdl = (False, True)  # the interpreter has no grid dependency control
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
    timer = Timer(device, sizes.smoke)
    copy = copy_bandwidth(timer, device, sizes.contiguous_bytes)
    configs = CONTIGUOUS_CONFIGS if not sizes.smoke else [(1024, 4, "", False)]
    if len(sizes.pdl) > 1:
        configs = configs + [(*config[:3], True) for config in configs]
    contiguous = contiguous_read(timer, device, sizes.contiguous_bytes, configs)
    report["ceilings"] = {"copy_TBps_rw": copy, "contiguous_read": contiguous}
    # the same-size reads: each method's best tiling of the 2 GiB read, and the steady one's
    same_configs = sorted({tuple(contiguous["best"][m]["point"].values()) for m in METHODS})
    ceilings = {"copy_TBps": copy, "contiguous": contiguous["best"], "contiguous_configs": same_configs}
    print(f"ceilings: copy {copy} TB/s r+w, contiguous read {contiguous['best']} ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    report["large_room"] = []
    for name in args.layouts.split(","):
        report["large_room"].append(bench_large_room(timer, name, device, sizes, ceilings, rng))
        r = report["large_room"][-1]
        print(f"{name}: best {r['best']} ratios {r['ratios']} ({time.perf_counter() - t0:.0f} s)", flush=True)
    report["launch_floor"] = launch_floor(timer, device)
    report["short_rooms"] = short_rooms(timer, device, sizes, kernel_shape(get_layout("fp8")), rng)
    write_result(args.out, "digest_gpu.json", report)
    print_report(report)
    s = report["short_rooms"]
    ok = (all(r["exact"] for r in report["exactness"]) and all(r["all_exact"] for r in report["large_room"])
          and s["exact"] and s.get("zero_syncs", True))
    return 0 if ok else 1


def print_report(report) -> None:
    print(f"\n{report['date']}  {report['device']}  torch {report['torch']}  triton {report['triton']}")
    print("exactness (digests, contents, out-of-range counts):", ", ".join(
        f"{r['layout']}/{r['memory']}={'OK' if r['exact'] else 'FAIL'} ({r['out_of_range_rows']} rows out of range)"
        for r in report["exactness"]))
    c = report["ceilings"]
    for m in METHODS:
        b = c["contiguous_read"]["best"][m]
        print(f"[{m}] ceilings: copy {c['copy_TBps_rw'][m]:.2f} TB/s (read+write); contiguous read 2 GiB "
              f"{b['read_TBps']:.2f} TB/s ({b['point']})")
    for r in report["large_room"]:
        for m in METHODS:
            b, q = r["best"][m], r["ratios"][m]
            g, same = r["gathered_read"].get("best", {}).get(m, {}), r["contiguous_same_size"]["best"][m]
            d = r["engine_default"]
            print(f"[{m}] {r['layout']} ({r['row_bytes']} B rows, {r['bytes_read'] / 1e6:.0f} MB): digest "
                  f"{b['ms'] * 1e3:.1f} us = {b['read_TBps']:.2f} TB/s ({b['point']}); / contiguous 2 GiB "
                  f"{q['contiguous']:.3f}, / same bytes {q['contiguous_same_size']:.3f} ({same['read_TBps']:.2f}), "
                  f"/ gathered {(q['gathered'] or 0):.3f} ({g.get('read_TBps', 0):.2f}), / copy {q['copy']:.3f}"
                  + (f"; engine default {d[m]:.2f} TB/s" if d else ""))
        n = r["no_contents"]
        print(f"[steady] {r['layout']} at the engine's shape without contents stored (diagnosis off): "
              f"{n['read_TBps']['steady']:.2f} TB/s = {r['no_contents_ratio']['steady']:.3f} of the 2 GiB read")
        print(f"{r['layout']}: every sweep point exact (cells and contents): {r['all_exact']}")
        e = r["engine_path"]
        if e:
            print(f"[flush_read] {r['layout']} as the engine digests it (DigestEngine.submit): "
                  f"{e['engine_submit_us']:.1f} us = {e['engine_read_TBps']:.2f} TB/s, without contents "
                  f"{e['engine_submit_us_no_contents']:.1f} us = {e['engine_read_TBps_no_contents']:.2f} TB/s "
                  f"({e['engine_dropped_batches'] + e['engine_dropped_batches_no_contents']} batches dropped); "
                  f"/ the 2 GiB read (flush_read) {e['engine_ratio']:.3f}, without contents "
                  f"{e['engine_ratio_no_contents']:.3f}; the collector's zeroing after it {e['zeroing_us']:.1f} us "
                  f"({e['zeroing_bytes']} B), without contents {e['zeroing_us_no_contents']:.1f} us; the same "
                  f"engine storing its cells (no device fold): {e['cells_engine_submit_us']:.1f} us, without contents "
                  f"{e['cells_engine_submit_us_no_contents']:.1f} us; "
                  f"the kernel storing into pinned host memory: {e['pinned_outputs_us']:.1f} us = "
                  f"{e['pinned_outputs_read_TBps']:.2f} TB/s")
            print(f"[steady] {r['layout']} as the engine digests it, submits back to back: "
                  f"{e['engine_steady_us']:.1f} us, without contents {e['engine_steady_us_no_contents']:.1f} us; "
                  f"/ the 2 GiB read (steady) {e['engine_steady_ratio']:.3f}, without contents "
                  f"{e['engine_steady_ratio_no_contents']:.3f}; storing its cells: {e['cells_engine_steady_us']:.1f} "
                  f"us, without contents {e['cells_engine_steady_us_no_contents']:.1f} us")
            print(f"[flush_read / steady] {r['layout']} as decode's engine digests it (contents; the collector "
                  f"copies them down on its own stream): serving stream {e['engine_submit_us_decode']:.1f} / "
                  f"{e['engine_steady_us_decode']:.1f} us a room = {e['engine_ratio_decode']:.3f} / "
                  f"{e['engine_steady_ratio_decode']:.3f} of the 2 GiB read; its copy down, alone "
                  f"{e['decode_copy_down_us']:.1f} us ({e['decode_copy_down_bytes']} B, copy engine)")
            print(f"[steady] {r['layout']} kernel at the engine's shape, back to back: storing cells "
                  f"{e['kernel_cells_steady_us']:.1f} us, with an event behind each {e['kernel_cells_event_steady_us']:.1f}; "
                  f"folding on the device {e['kernel_fold_steady_us']:.1f}, with an event behind each "
                  f"{e['kernel_fold_event_steady_us']:.1f}; folding at rows x warps "
                  + ", ".join(f"{k} {v:.1f}" for k, v in e["kernel_fold_steady_us_by_shape"].items()))
            print(f"[flush_read] {r['layout']} room of 64 pages: engine {e['medium_engine_us']:.1f} us, without "
                  f"contents {e['medium_engine_us_no_contents']:.1f}; kernel alone, outputs in pinned memory "
                  f"{e['medium_pinned_outputs_us']:.1f}, in device memory {e['medium_device_outputs_us']:.1f}")
    s, f = report["short_rooms"], report["launch_floor"]
    for m in METHODS:
        print(f"[{m}] {s['rooms']} short rooms ({s['pages']} pages x {s['layers']} layers) in one launch: "
              f"{s['kernel_us'][m]:.1f} us, {s['kernel_us_per_room'][m]:.2f} us GPU/room ({s['read_TBps'][m]:.2f} TB/s); "
              f"digest kernel on a room with no pages {s['digest_kernel_no_pages_gpu_us'][m]:.1f} us"
              + (f"; empty Triton kernel {f['empty_kernel_gpu_us'][m]:.1f} us GPU" if f else ""))
    print(f"short rooms exact: {s['exact']}")
    if f:
        print(f"launch floor: empty Triton kernel {f['empty_kernel_cpu_us_jit']:.1f} us CPU (JIT), "
              f"{f['empty_kernel_cpu_us_direct']:.1f} us CPU (C launcher)")
    if "zero_syncs" in s:
        print(f"[flush_read] the same {s['rooms']} rooms as the engine digests them (copies included): "
              f"{s['engine_gpu_us_per_room']:.2f} us GPU/room, without contents "
              f"{s['engine_gpu_us_per_room_no_contents']:.2f}; the kernel storing into pinned host memory "
              f"{s['pinned_outputs_us_per_room']:.2f}")
        print(f"enqueue CPU {s['enqueue_cpu_us_per_room_batched']:.1f} us/room batched, "
              f"{s['enqueue_cpu_us_per_room_single']:.1f} us/room single; zero syncs: {s['zero_syncs']}")


if __name__ == "__main__":
    sys.exit(main())
