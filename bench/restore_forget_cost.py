"""What forgetting a pool's kept HiCache digests costs the thread that forgets, and the collector after it.

Why: a token-granular backup into an index-K pool (and a collector far behind) makes SGLang's
copying thread forget all of that pool's kept backup digests (`HostPageDigests.forget_all`,
docs/hicache.md). It used to walk the whole table there; it now moves the pool to a new epoch
and the collector's stores after it sweep the forgotten entries out, `SWEEP_CHUNK` keys a store.
This times, on a table filled to `--entries` over two pools (the forgotten pool holds half):
the forget on the calling thread; the collector's first store after it (the key list taken,
one chunk swept) and its stores until the sweep is done; against, in the same run, one Python
pass over the table's keys that picks the pool's (what the old forget did before deleting
each and remembering it lost), the floor of any walk.

Usage:  python -m bench.restore_forget_cost [--entries 262144] [--layers 30] [--rounds 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.harness import Table, command_line, median, write_result
from dsv4_idxk_probe.hicache.restore_store import HostPageDigests


def filled(entries: int, layers: int) -> HostPageDigests:
    """A store at its bound, pools 0 and 1 alternating in batches of 1,024 rows."""
    store = HostPageDigests(entries)
    batch = np.zeros((layers, 1024, 2), dtype=np.uint64)
    for b in range(entries // 1024):
        store.put(b % 2, range(b * 1024, (b + 1) * 1024), batch)
    return store


def one_round(entries: int, layers: int) -> dict[str, float]:
    store = filled(entries, layers)
    started = time.perf_counter()
    walked = [key for key in store._table if key[0] == 0]  # the floor of a walk, not part of the product
    walk = time.perf_counter() - started
    started = time.thread_time()
    store.forget_all(0, fence=True)
    forget = time.thread_time() - started
    row = np.zeros((layers, 1, 2), dtype=np.uint64)
    stores = []
    while store._unswept or store._sweep_keys is not None:
        started = time.thread_time()
        store.put(1, [len(stores) % 1024], row, store.generations.get(1, 0))
        stores.append(time.thread_time() - started)
    return {"forgotten": len(walked), "walk_ms": walk * 1e3, "forget_ms": forget * 1e3,
            "first_store_ms": stores[0] * 1e3, "stores": len(stores), "later_store_ms": median(stores[1:]) * 1e3,
            "sweep_ms": sum(stores) * 1e3}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=262_144, help="kept host pages (the default bound)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args(argv)
    rounds = [one_round(args.entries, args.layers) for _ in range(args.rounds)]
    table = Table(("round", "5d"), ("forgotten", "9d"), ("walk ms", "8.2f"), ("forget ms", "9.3f"),
                  ("ratio", "6.4f"), ("1st store ms", "12.2f"), ("stores", "6d"), ("later store ms", "14.2f"),
                  ("sweep ms", "8.1f"))
    print(f"{command_line('restore_forget_cost', argv)}\n{args.entries} entries over two pools; "
          "thread CPU, the walk in wall time (same thread, nothing beside it)")
    print(table.header())
    for r, m in enumerate(rounds):
        print(table.row(r, m["forgotten"], m["walk_ms"], m["forget_ms"], m["forget_ms"] / m["walk_ms"],
                        m["first_store_ms"], m["stores"], m["later_store_ms"], m["sweep_ms"]))
    if args.out is not None:
        write_result(args.out, "restore_forget_cost.json", {"args": vars(args), "rounds": rounds})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
