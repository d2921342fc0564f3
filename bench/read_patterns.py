"""Where a gathered index-K read loses to a contiguous one: a study of read patterns on a GPU.

Why (issue 21): the digest reads fp8 and fp4 rows at 0.965-0.98 of a plain
read of the same gathered rows, and that plain read reaches only 0.86-0.91 of
a contiguous read. This separates the causes, all in one process, each timed
by the `steady` method of bench/digest_gpu.py (back-to-back launches rotating
over two inputs far larger than L2):
  - the page table: random pages of the pool, or consecutive pages (the
    rows contiguous within each layer's buffer);
  - the grid order: the layer fastest (a wave reads one page of every layer)
    or the page fastest (a wave reads consecutive pages of one layer);
  - loads with eviction_policy="evict_first" or plain;
  - rows per program and warps;
for a plain sum of the rows; and for the digest kernel itself, the room
passed by value (as the engine passes a room alone) or read from the room
table, that table and the outputs in device or in pinned host memory (where
the engine keeps them); beside the contiguous read of the same bytes and of
2 GiB. Prints registers per thread beside each point.

Usage:  python3 -m bench.read_patterns [--out DIR] [--layouts fp8,fp4,bf16]
        python3 -m bench.read_patterns --smoke   (no GPU: the interpreter, tiny sizes)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from datetime import datetime, timezone

import numpy as np
import torch

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from bench import digest_gpu  # noqa: E402  (the timer, pools, launches and contiguous read of the digest bench)
from bench.harness import write_result  # noqa: E402
from dsv4_idxk_probe.digest import RoomRequest, get_layout  # noqa: E402

TABLES = ("random", "consecutive")


def _registers(compiled):
    """Registers per thread of a compiled kernel (None under the interpreter)."""
    return getattr(compiled, "n_regs", None)


def page_tables(kind, pool_pages, n_pages, device) -> list[torch.Tensor]:
    """Two page tables over disjoint pages of the pool, of `kind`."""
    if kind == "consecutive":
        return [torch.arange(i * (pool_pages // 2), i * (pool_pages // 2) + n_pages, device=device) for i in range(2)]
    perm = torch.randperm(pool_pages, device=device)
    tables = [perm[i * n_pages:(i + 1) * n_pages].contiguous() for i in range(2)]
    return [t.sort().values.contiguous() for t in tables] if kind == "sorted" else tables


def plain_reads(timer, layout, bufs, launch, tables, device, shapes) -> list[dict]:
    row_words = layout.row_bytes // 4
    head = 1 << (row_words.bit_length() - 1)
    n_pages = tables[0].numel()
    out = torch.empty(len(bufs) * n_pages, dtype=torch.uint32, device=device)
    nbytes = len(bufs) * n_pages * layout.row_bytes
    results = []
    for (rows, warps), page_major, evict in itertools.product(shapes, (False, True), (False, True)):
        blocks = -(-n_pages // rows)
        grid = (blocks, len(bufs)) if page_major else (len(bufs), blocks)
        fns = [lambda t=t: digest_gpu._gathered_sum[grid](launch.layers, t, out, n_pages, ROW_WORDS=row_words, HEAD=head,
                                               TAIL=row_words - head, BASE_ALIGN=launch.base_align, ROWS=rows,
                                               PAGE_MAJOR=page_major, POLICY="evict_first" if evict else "",
                                               num_warps=warps)
               for t in tables]
        ms = timer.ms("steady", fns)
        results.append({"rows": rows, "warps": warps, "page_major": page_major, "evict_first": evict,
                        "us": ms * 1e3, "read_TBps": nbytes / (ms * 1e-3) / 1e12, "regs": _registers(fns[0]())})
    return results


def digest_reads(timer, layout, bufs, tables, device, shapes, rng, sample_pages) -> list[dict]:
    """The digest kernel over the same rows: the room passed by value (as the engine passes
    a room alone) or read from the room table, that table and the outputs in device
    memory or in pinned host memory (where the engine keeps them)."""
    n_pages = tables[0].numel()
    nbytes = len(bufs) * n_pages * layout.row_bytes
    results = []
    for by_value, pinned in itertools.product((True, False), (False, True)):
        launches = [digest_gpu.Launch(layout, bufs, [RoomRequest(f"r{i}", t, n_pages * 256)], device,
                                      by_value=by_value, pinned=pinned) for i, t in enumerate(tables)]
        samples = [launch.sample_reference(rng, sample_pages) for launch in launches]
        for rows, warps in shapes:
            for launch in launches:
                launch.kernel = digest_gpu.DigestKernel(launch.layers, len(bufs), layout, rows=rows, num_warps=warps,
                                                        base_align=launch.base_align)
                launch.cells.fill_(0x5A5A)
                launch.contents.fill_(0x5A5A)
            ms = timer.ms("steady", launches)
            compiled = launches[0].kernel.compiled.get(launches[0].one_room is not None)
            results.append({"regs": _registers(compiled), "rows": rows, "warps": warps, "by_value": by_value,
                            "pinned": pinned, "us": ms * 1e3, "read_TBps": nbytes / (ms * 1e-3) / 1e12,
                            "exact": all(launch.exact_on(s) for launch, s in zip(launches, samples))})
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--layouts", default="fp8,fp4,bf16")
    parser.add_argument("--smoke", action="store_true", help="no GPU: the interpreter, tiny sizes")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    sizes = digest_gpu.Sizes(args.smoke)
    timer = digest_gpu.Timer(device, args.smoke)
    rng = np.random.default_rng(int(time.time()))
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__}
    configs = [(1024, 4, "")] if args.smoke else digest_gpu.CONTIGUOUS_CONFIGS
    report["contiguous_2GiB"] = digest_gpu.contiguous_read(timer, device, sizes.contiguous_bytes, configs)["best"]["steady"]
    ceiling = report["contiguous_2GiB"]["read_TBps"]
    print(f"contiguous 2 GiB: {ceiling:.3f} TB/s", flush=True)
    report["layouts"] = {}
    for name in args.layouts.split(","):
        layout = get_layout(name)
        pool_pages = 2 * sizes.pages + 64
        bufs = digest_gpu.random_pool(layout, sizes.layers, pool_pages, device)
        nbytes = sizes.layers * sizes.pages * layout.row_bytes
        same = digest_gpu.contiguous_read(timer, device, nbytes, configs)["best"]["steady"]
        entry = {"row_bytes": layout.row_bytes, "bytes": nbytes, "contiguous_same_bytes": same, "tables": {}}
        warps = (1, 2, 4) if layout.row_bytes <= 8448 else (2, 4, 8)
        shapes = [(1, w) for w in warps] + [(2, warps[0])]
        digest_shapes = [(1, 1), (1, 2)] if layout.row_bytes <= 8448 else [(1, 4), (1, 8)]
        for kind in TABLES:
            tables = page_tables(kind, pool_pages, sizes.pages, device)
            launch = digest_gpu.Launch(layout, bufs, [RoomRequest("plain", tables[0], sizes.pages * 256)], device)
            plain = plain_reads(timer, layout, bufs, launch, tables, device, shapes)
            digests = digest_reads(timer, layout, bufs, tables, device, digest_shapes, rng, 8)
            entry["tables"][kind] = {"plain": plain, "digest": digests}
            for label, rows in (("plain", plain), ("digest", digests)):
                best = max(rows, key=lambda r: r["read_TBps"])
                print(f"{name} {kind:11s} {label:6s} best {best['read_TBps']:.3f} TB/s = {best['read_TBps'] / ceiling:.3f}"
                      f" of 2 GiB, {best['read_TBps'] / same['read_TBps']:.3f} of same bytes  {best}", flush=True)
                for r in rows:
                    flags = " ".join(f"{k}={r[k]:d}" for k in ("page_major", "evict_first", "by_value", "pinned") if k in r)
                    print(f"    {r['rows']}x{r['warps']} {flags} {r['us']:8.1f} us {r['read_TBps']:.3f} TB/s {r['regs']} regs"
                          + (f" exact={r['exact']}" if "exact" in r else ""))
        print(f"{name}: contiguous same bytes {same['read_TBps']:.3f} TB/s = {same['read_TBps'] / ceiling:.3f}", flush=True)
        report["layouts"][name] = entry
        del bufs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_result(args.out, "read_patterns.json", report)
    exact = all(r.get("exact", True) for e in report["layouts"].values() for t in e["tables"].values()
                for r in t["digest"])
    print("every digest point exact:", exact)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
