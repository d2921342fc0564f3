"""What the L3 sidecar's checks add to SGLang's storage threads, per index-K page.

Why: a page `HiCacheFile._write_page` stores anew is read back and compared with the
host row it came from (another writer of the key may have replaced it), besides the
stats and the old sidecar's unlink; a page `_read_page` reads is stated before and
after (docs/hicache.md, "A sidecar belongs to one stored page"). Those run on the
thread that writes or reads the page file, not the scheduler's. This prices them
against that thread's own work for the same page: SGLang's `HiCacheFile.set` (a new
key each time, so every page is stored anew) and `HiCacheFile.get`, on a real
`HiCacheFile` in a temporary folder (the page cache, as a warm local disk serves it).
The probe's calls are the product's own (`dsv4_idxk_probe.sglang.l3_files`, the read
hook's `_read_sidecar`). "write checks": the write hook's, on the storage thread;
"sidecar write": the sidecar's own write, on the probe's collector thread (its page's
version before and after, the metadata cache's entry forgotten, `set` of the small
file); "read checks": the read hook's, the sidecar's read included.

Usage:  python -m bench.l3_sidecar_cost [--layers 30] [--row-bytes 8448] [--pages 300] [--rounds 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.harness import Table, command_line, median, write_result
from dsv4_idxk_probe.sglang import l3_files

SIDECAR = ".dsv4-idxk-digest"


def file_backend(folder: Path):
    """SGLang's file backend as an MLA model's first rank builds it (the fields this release has)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    wanted = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=True,
                  enable_storage_metrics=False, is_page_first_layout=False, model_name="bench",
                  extra_config={"file_storage_path": str(folder)})
    fields = {f.name for f in dataclasses.fields(HiCacheStorageConfig)}
    return HiCacheFile(HiCacheStorageConfig(**{k: v for k, v in wanted.items() if k in fields}), file_path=str(folder))


def thread_us(fn) -> float:
    started = time.thread_time()
    fn()
    return (time.thread_time() - started) * 1e6


def one_round(backend, host_layers: list[np.ndarray], row: int, pages: int, round_no: int) -> dict[str, list[float]]:
    """`pages` pages stored anew and read back: SGLang's calls and the probe's, each timed alone.
    The page is host row `row` of every layer, flat (as `get_data_page(flat=True)` gives `set`);
    the probe's check reads it from the layers' arrays as the hook does (`PoolState.host_arrays`).
    The sidecar is written as the collector writes it and read as the read hook reads it."""
    from dsv4_idxk_probe.hicache.restore import sidecar_bytes
    from dsv4_idxk_probe.sglang.hicache import _read_sidecar

    page = torch.from_numpy(np.concatenate([layer[row] for layer in host_layers]))
    target = torch.empty_like(page)
    nbytes = sidecar_bytes(len(host_layers), 2)
    sidecar_value = torch.zeros(nbytes, dtype=torch.uint8)
    times: dict[str, list[float]] = {k: [] for k in ("set", "write_checks", "sidecar_write", "get", "read_checks")}
    for i in range(pages):
        key = f"r{round_no}-p{i}"
        sidecar, path = key + SIDECAR, l3_files.stored_path(backend, key)
        times["write_checks"].append(thread_us(lambda: l3_files.file_version(path)))  # before the call
        times["set"].append(thread_us(lambda: backend.set(key, page)))
        versions = []
        times["write_checks"][-1] += thread_us(lambda: (
            l3_files.stored_anew(None, l3_files.file_version(path)),
            l3_files.remove_stored(backend, sidecar),
            versions.append(l3_files.holding(path, [layer[row] for layer in host_layers]))))
        times["sidecar_write"].append(thread_us(lambda: l3_files.write_while_current(
            backend, sidecar, path, versions[0], lambda: l3_files.set_anew(backend, sidecar, sidecar_value))))
        times["read_checks"].append(thread_us(lambda: l3_files.file_version(path)))
        times["get"].append(thread_us(lambda: backend.get(key, target)))
        times["read_checks"][-1] += thread_us(lambda: (_read_sidecar(backend, sidecar, nbytes),
                                                       l3_files.file_version(path)))
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--row-bytes", type=int, default=8448, help="fp8 index-K row (4352: fp4)")
    parser.add_argument("--pages", type=int, default=300, help="pages stored and read per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(5)
    host_layers = [rng.integers(0, 256, (8, args.row_bytes), dtype=np.uint8) for _ in range(args.layers)]
    rounds = []
    with tempfile.TemporaryDirectory(prefix="l3-sidecar-cost-") as folder:
        backend = file_backend(Path(folder))
        for r in range(args.rounds):
            times = one_round(backend, host_layers, 3, args.pages, r)
            rounds.append({k: median(v) for k, v in times.items()})
    table = Table(("round", "5d"), ("set us", "8.1f"), ("write checks us", "15.1f"), ("ratio", "6.3f"),
                  ("sidecar write us", "16.1f"), ("get us", "8.1f"), ("read checks us", "14.1f"), ("ratio", "6.3f"))
    lines = [table.header()]
    for r, m in enumerate(rounds):
        lines.append(table.row(r, m["set"], m["write_checks"], m["write_checks"] / m["set"], m["sidecar_write"],
                               m["get"], m["read_checks"], m["read_checks"] / m["get"]))
    print(f"{command_line('l3_sidecar_cost', argv)}\n"
          f"page {args.layers * args.row_bytes} B ({args.layers} layers x {args.row_bytes} B); "
          "thread CPU per page, median per round")
    print("\n".join(lines))
    if args.out is not None:
        write_result(args.out, "l3_sidecar_cost.json", {"args": vars(args) | {"out": str(args.out)}, "rounds": rounds})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
