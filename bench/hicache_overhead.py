"""CPU cost the HiCache host-pool wrappers add to each copy call, and (on a GPU)
proof that they add no host-device synchronisation.

Measured per call, as thread CPU time averaged over --calls calls, per round;
the median and the minimum over rounds are printed (the minimum is the cost
without interference on a shared machine). Bare and wrapped rounds alternate
so drift hits both:
  * backup: one page-path backup of PAGES pages over all layers;
  * load, next layer: a per-layer load with the index tensors of the previous
    call (what every layer after the first sees);
  * load, every layer: a whole load, one call per layer, per "call" here (its
    last layer completes it, and restore verification, on by default, digests
    the pages it wrote; before 2026-12-07 the last layer's call alone, which no
    longer completes a load by itself);
  * load, new indices: a per-layer load with fresh index tensors each call;
each bare (no probe), wrapped with index checks on (the default) and
wrapped with index checks off. Round-trip mode is off throughout. The
flusher's work (publishing counts, running the index checks) happens between
rounds, outside the timings: it runs on its own thread.

Restore verification launches a digest per backup and per load; its collector
thread reads the host rows back. Every `--burst` calls the timing pauses until
the collector has caught up, as it does between a serving thread's copies (a
collector that lags makes the copying thread allocate staging buffers and
events; `--burst 0` measures that). A probe failure on any thread (the
collector's included) fails the run.

`--count` counts instead of timing (any machine, no GPU): Python calls, C calls
and bytecodes on the copying thread per call, with restore verification's
digest engine on its CUDA path and its device calls faked as `bench.hook_ops`
fakes them.

Two ways to get a pool:
  * default: SGLang's real ``DeepSeekV4PagedHostPool`` (needs sglang); on CPU
    its copy ops are undefined, so no-op stand-ins are injected into its
    module (the bare call is then SGLang's Python dispatch alone); on CUDA the
    real sgl_kernel ops run;
  * ``--standalone``: no sglang; a minimal pool with the same method
    signatures whose copy is a device-side gather/scatter, wrapped by the same
    adapter factories.

With ``--device cuda`` every timed call runs under
``torch.cuda.set_sync_debug_mode("error")``: the first synchronising call
raises and the script exits non-zero. A deliberately straddling page group is
then checked to have been counted, proving the checks ran on the device.

Usage:  python -m bench.hicache_overhead [--device cpu|cuda] [--standalone] [--rounds R] [--calls N]
                                         [--burst B] [--count]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from types import SimpleNamespace

import torch
import wrapt
from prometheus_client import CollectorRegistry

from bench.harness import Table, median, per_call_us
from dsv4_idxk_probe.hicache import forget, probe_for
from dsv4_idxk_probe.metrics.definitions import ProbeMetrics, process_labels
from dsv4_idxk_probe.safety import error_counts
from dsv4_idxk_probe.sglang import hicache as adapter

LAYERS, PAGE, PAGES, HOST_PAGES, DEVICE_PAGES, ITEM = 4, 256, 4, 64, 64, 8448
METHODS = {
    "backup_from_device_all_layer": adapter.make_backup_wrapper,
    "load_to_device_per_layer": adapter.make_load_wrapper,
    "backup_tokens_from_device_all_layer": adapter.make_backup_tokens_wrapper,
}


# %% pools


class StandalonePool:
    """Just enough of DeepSeekV4PagedHostPool (layer_first) for the adapter, with device-side
    gather/scatter copies: a row is a page group of `slot_page_size` indices, found as the
    group's first index over the page size, as the pool computes it. Shared by the benches."""

    def __init__(self, device, *, layers: int = LAYERS, host_pages: int = HOST_PAGES, device_pages: int = DEVICE_PAGES,
                 item_bytes: int = ITEM, page_tokens: int = PAGE, name: str = "standalone_indexer", seed: int | None = None):
        self.pool_name, self.layer_num, self.item_bytes = name, layers, item_bytes
        self.slot_page_size, self.num_host_pages, self.layout, self.page_aligned_only = page_tokens, host_pages, "layer_first", False
        g = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
        self.device_buffers = [
            (torch.randint(0, 256, (device_pages, item_bytes), dtype=torch.uint8, generator=g) if g is not None
             else torch.zeros(device_pages, item_bytes, dtype=torch.uint8)).to(device)
            for _ in range(layers)
        ]
        self.kv_buffer = [torch.zeros(host_pages, item_bytes, dtype=torch.uint8, device=device) for _ in range(layers)]

    def _rows(self, indices):
        return indices.reshape(-1, self.slot_page_size)[:, 0] // self.slot_page_size

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
        host_rows, device_rows = self._rows(host_indices), self._rows(device_indices)
        for src, dst in zip(self.device_buffers, self.kv_buffer):
            dst.index_copy_(0, host_rows, src.index_select(0, device_rows))

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False):
        rows = self._rows(device_indices)
        self.device_buffers[layer_id].index_copy_(0, rows, self.kv_buffer[layer_id].index_select(0, self._rows(host_indices)))

    def backup_tokens_from_device_all_layer(self, host_indices, device_indices):
        raise ValueError("token path not used here")


def sglang_pool(device):
    import sglang.srt.mem_cache.memory_pool_host as mph
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    if device == "cpu":  # CUDA-only names: stand in with no-ops (measures dispatch, not copying)
        for name in ("transfer_kv_all_layer_mla", "transfer_kv_per_layer_mla", "transfer_kv_all_layer_mla_lf_pf",
                     "transfer_kv_per_layer_mla_pf_lf"):  # fmt: skip
            setattr(mph, name, lambda **_: None)
    buffers = [torch.zeros(DEVICE_PAGES, ITEM, dtype=torch.uint8, device=device) for _ in range(LAYERS)]
    with host_memory_budget_scope(1 << 40):
        pool = mph.DeepSeekV4PagedHostPool(
            pool_name="deepseek_v4_c4_indexer", device_buffers=buffers, item_bytes=ITEM, num_host_pages=HOST_PAGES,
            slot_page_size=PAGE, layout="layer_first", device="cpu", pin_memory=device != "cpu",
        )  # fmt: skip
    return mph.DeepSeekV4PagedHostPool, pool


# %% measuring


def indices(first_page: int, device) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + PAGES) * PAGE, dtype=torch.int64, device=device)


def cpu_us(fn, calls: int, burst: int = 0, between=None) -> float:
    """Thread CPU time per call, in microseconds, averaged over `calls` calls; with `burst`,
    `between()` runs untimed after every `burst` calls (the restore collector catching up,
    as it does between a serving thread's copies)."""
    if not burst or between is None:
        return per_call_us(fn, calls, clock=time.thread_time)
    spent, done = 0.0, 0
    while done < calls:
        n = min(burst, calls - done)
        started = time.thread_time()
        for _ in range(n):
            fn()
        spent += time.thread_time() - started
        done += n
        between()
    return spent / calls * 1e6


def closed_cleanly(installs, before: dict | None = None) -> bool:
    """Drain and forget each install's probe; False (said) when any thread counted a probe
    failure (since `before`, an `error_counts()` taken earlier: the counts are the process's)."""
    for inst in installs:
        inst.drain()
        forget(inst.runtime)
    before = before or {}
    failures = {name: n - before.get(name, 0) for name, n in error_counts().items() if n > before.get(name, 0)}
    if failures:
        print(f"FAIL: probe failures counted during the run: {failures}")
    return not failures


class Installed:
    def __init__(self, cls, index_checks: bool):
        self.registry = CollectorRegistry()
        self.runtime = SimpleNamespace(
            metrics=ProbeMetrics(self.registry),
            config=SimpleNamespace(hicache={"index_checks": index_checks, "flush_interval_s": 3600.0,
                                            "index_queue_max": 1_000_000}),  # fmt: skip
            emit=lambda record: None,
            log=logging.getLogger("bench.hicache"),
        )
        self.cls, self.handles = cls, []

    def __enter__(self):
        for name, factory in METHODS.items():
            self.handles.append((name, wrapt.wrap_function_wrapper(self.cls, name, factory(self.runtime))))
        return self

    def __exit__(self, *exc):
        for name, handle in self.handles:
            if hasattr(wrapt, "unwrap_object"):
                wrapt.unwrap_object(self.cls, name, handle)
            else:  # wrapt 1.x (a GPU image may carry one): the proxy keeps the original
                setattr(self.cls, name, self.cls.__dict__[name].__wrapped__)
        self.handles.clear()

    def drain(self):
        restore = probe_for(self.runtime).restore
        if restore is not None:
            restore.drain()

    def flush(self):
        checker = probe_for(self.runtime).checker
        if checker is not None:
            checker.flush()


def faked_cuda_engine(layout, layer_ids, buffers, queue_max, **per_pool):
    """Restore verification's digest engine taking its CUDA submit path, device calls faked
    (`bench.hook_ops.fake_device_calls`): what a copy call costs the copying thread on a GPU,
    counted on any machine. `per_pool`: what `RestoreVerifier` sets per pool (`restore.engine_options` too)."""
    from bench.hook_ops import fake_device_calls
    from dsv4_idxk_probe.digest import DigestEngine

    options = dict(per_pool, prealloc=4)  # as the product builds it (`restore._engine`), less staging
    return fake_device_calls(DigestEngine(layout, layer_ids, buffers, backend="triton", max_pending=queue_max,
                                          **options))


def copy_cases(pool, host, device, layers: int) -> dict:
    """The copying thread's calls `--count` counts (and tests/hicache/test_copy_path_calls.py),
    each (uncounted calls before, the call counted, uncounted calls after): each load case is a
    whole load, so it starts with no layer of another in; its last layer completes it (the digest)."""

    def load(*layer_ids):
        def run():
            for layer in layer_ids:
                pool.load_to_device_per_layer(None, host, device, layer, "kernel")

        return run

    def nothing():
        pass

    return {
        "backup": (nothing, lambda: pool.backup_from_device_all_layer(None, host, device, "kernel"), nothing),
        "load, a middle layer": (load(0), load(1), load(*range(2, layers))),
        "load, the last layer": (load(*range(layers - 1)), load(layers - 1), nothing),
    }


def count_calls(cls, pool, calls: int) -> int:
    """`--count`: Python calls, C calls and bytecodes on the copying thread per call, bare and
    wrapped (index checks on, restore verification on with a faked-CUDA engine), medians."""
    from bench.harness import CallCounter

    cases = copy_cases(pool, indices(0, "cpu"), indices(8, "cpu"), LAYERS)
    counter, results = CallCounter(), {}
    for variant in ("bare", "wrapped"):
        inst = Installed(cls, True) if variant == "wrapped" else None
        restore = None
        if inst is not None:
            restore = probe_for(inst.runtime).restore
            restore._engine_factory = faked_cuda_engine
        with inst if inst is not None else _nothing():
            for before, fn, after in cases.values():  # registers the pool and builds its engine: not counted
                before(), fn(), after()
            for case, (before, fn, after) in cases.items():
                samples = []
                def make(before=before, fn=fn):  # each counted call's set-up (`count` makes two)
                    before()
                    if restore is not None:
                        restore.drain()  # events and buffers back in their pools, as between real calls
                    return fn

                for _ in range(calls):
                    samples.append(counter.count(make))
                    after()
                results[(case, variant)] = {k: median(s[k] for s in samples) for k in samples[0]}
        if inst is not None:
            forget(inst.runtime)
    print(f"copying-thread work per call ({LAYERS} layers, {PAGES} pages per call; restore digest engine on its CUDA "
          f"path, device calls faked; medians over {calls} calls)")
    table = Table(("case", "<26"), ("variant", "<8"), ("Python calls", "12.0f"), ("C calls", "8.0f"),
                  ("bytecodes", "10.0f"))
    print(table.header())
    for (case, variant), r in results.items():
        print(table.row(case, variant, r["python_calls"], r["c_calls"], r["opcodes"]))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--standalone", action="store_true", help="no sglang: a minimal pool with the same methods")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--burst", type=int, default=16,
                        help="calls between two untimed waits for the restore collector (0: never wait; a "
                             "collector that lags allocates staging and events on the copying thread)")
    parser.add_argument("--count", action="store_true",
                        help="count the copying thread's calls and bytecodes instead of timing (CPU, standalone pool)")
    args = parser.parse_args(argv)
    if args.count:
        torch.set_num_threads(1)
        return count_calls(StandalonePool, StandalonePool(torch.device("cpu")), min(args.calls, 200))
    dev = torch.device(args.device)
    torch.set_num_threads(1)  # tiny index tensors; keeps intra-op thread pools out of the timings
    if args.standalone:
        cls, pool = StandalonePool, StandalonePool(dev)
    else:
        cls, pool = sglang_pool(args.device)
    host, device = indices(0, dev), indices(8, dev)
    fresh = [(indices(i, dev), indices(8 + i, dev)) for i in range(2)]
    step = {"n": 0}

    def new_indices_load():
        step["n"] += 1
        h, d = fresh[step["n"] & 1]
        pool.load_to_device_per_layer(None, h, d, 1, "kernel")

    cases = {
        "backup": lambda: pool.backup_from_device_all_layer(None, host, device, "kernel"),
        "load, next layer": lambda: pool.load_to_device_per_layer(None, host, device, 1, "kernel"),
        "load, every layer": lambda: [pool.load_to_device_per_layer(None, host, device, layer, "kernel")
                                      for layer in range(LAYERS)],
        "load, new indices": new_indices_load,
    }
    variants = {"bare": None, "wrapped, index checks on": True, "wrapped, index checks off": False}
    installs = {name: Installed(cls, checks) for name, checks in variants.items() if checks is not None}
    results = {case: {v: [] for v in variants} for case in cases}
    sync_check = args.device == "cuda"

    for variant, inst in installs.items():  # first call registers the pool; keep it out of the timings
        with inst:
            for fn in cases.values():
                fn()
            inst.flush()
    for _ in range(args.rounds):
        for variant in variants:
            inst = installs.get(variant)
            with inst if inst is not None else _nothing():
                for case, fn in cases.items():
                    if sync_check:
                        torch.cuda.synchronize()
                        torch.cuda.set_sync_debug_mode("error")
                    try:
                        results[case][variant].append(
                            cpu_us(fn, args.calls, args.burst, inst.drain if inst is not None else None))
                    finally:
                        if sync_check:
                            torch.cuda.set_sync_debug_mode(0)
                if inst is not None:
                    inst.flush()

    if sync_check:  # the checks really ran on the device: a straddling group must be counted
        inst = installs["wrapped, index checks on"]
        with inst:
            torch.cuda.set_sync_debug_mode("error")
            try:
                pool.backup_from_device_all_layer(None, host, device + PAGE // 2, "kernel")
            finally:
                torch.cuda.set_sync_debug_mode(0)
            inst.flush()
        got = inst.registry.get_sample_value(
            "dsv4_idxk_probe_hicache_index_violations_total",
            {**process_labels({}), "pool": pool.pool_name, "direction": "d2h", "check": "device_unaligned"},
        )
        if got != PAGES:
            print(f"FAIL: expected {PAGES} device_unaligned violations from the device checks, got {got}")
            return 1
        print(f"sync check: no synchronising call in any timed wrapped call; device checks counted {int(got)} straddles")

    if not closed_cleanly(installs.values()):
        return 1
    mode = "standalone" if args.standalone else "sglang DeepSeekV4PagedHostPool"
    print(f"\ndevice={args.device} pool={mode} layers={LAYERS} pages/call={PAGES} rounds={args.rounds} calls={args.calls}")
    table = Table(("case", "<20"), ("variant", "<28"), ("median us", "9.2f"), ("added", "7.2f"), ("ratio", "6.2f"),
                  ("min us", "8.2f"), ("added", "7.2f"), ("ratio", "6.2f"))
    print(table.header())
    worst = 0.0
    for case, by_variant in results.items():
        bare_med, bare_min = median(by_variant["bare"]), min(by_variant["bare"])
        for variant, samples in by_variant.items():
            med, low = median(samples), min(samples)
            print(table.row(case, variant, med, med - bare_med, med / bare_med, low, low - bare_min, low / bare_min))
            if variant != "bare":
                worst = max(worst, low - bare_min)
    print(f"\nworst added CPU time per wrapped call (min over rounds): {worst:.2f} us (budget 20 us)")
    return 0 if worst <= 20.0 else 2


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
