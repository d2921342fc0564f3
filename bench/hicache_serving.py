"""HiCache restore verification inside serving-shaped traffic: rooms/s with it on and off.

Why: the host-pool leg (`bench.overhead --skip-rig`) runs copies back to back and
nothing else, so it prices a copy, not serving. Here one thread serves as a
scheduler does: each model step admits `--rooms-per-step` rooms; every room's
prefix is written through to the host pool (one page-path backup over all layers,
as `backup_from_device_all_layer` is called per written-through prefix), a share
of them (`--restore-share`) first restores a prefix from the host pool (the
pool's per-layer loads, every layer), and then the model step passes
(`--step-ms`, waited as `--step-wait` says: the rig's model-time waits). On CUDA the
copies run on two streams of their own, a backup's on one and a load's on the other, as
SGLang's `L2TransferEngine` runs them (`device_to_host_stream`, `host_to_device_stream`),
never on the model's (`--copy-streams current` puts them there). Rooms/s
over `--target-seconds` per run (and the serving thread's own CPU time per room
while admitting: what the copies and the probe cost it, without waits for the GIL
or the cores); the two variants differ only in
`hicache.restore_verify` (the rest of the probe is the same; its flusher, and with it
the index checks, first runs `flush_interval_s` after a run starts, so past a run
shorter than that in neither variant), run interleaved in `--reps` pairs, off first
in even pairs and on first in odd ones; the report is the per-pair ratio on/off and
its median. In every run the same rooms of a step restore (the run counts its own
rooms: the ring's room number differs between runs). A run is valid only if every
load the restore-on runs made was compared and every comparison says `match`,
and no index-K byte of theirs was counted unverified (a digest dropped for a full
queue would otherwise make the variant cheaper and still look verified).

What it does not price: the model forward is a GPU kernel the serving thread waits
on with the GIL released, so the restore collector's work falls in that wait; a
scheduler that works on its next batch during the forward (SGLang's overlap
scheduler) would share the GIL with it. Index tensors made under inference mode
(`SGLANG_ENABLE_TORCH_INFERENCE_MODE`) cost restore verification a clone per copy
on the copying thread; here they are plain tensors, SGLang's default.

The pool is the standalone DeepSeek-V4 index-K host pool shape of
`bench.hicache_overhead` (no SGLang needed: the GPU machine has none): fp8 rows
of 8448 B, 256 slots per page, `--layers` layers, `--pages` pages per prefix,
index tensors on the pool's device (as SGLang's kernel io backend passes them).

Usage:  python3 -m bench.hicache_serving [--device cpu|cuda] [--reps 7] [--target-seconds 2]
                                         [--step-ms 10] [--step-wait sleep|spin|gpu] [--copy-streams sglang|current]
                                         [--restore-record collector|copy] [--sync-debug] [--out DIR]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
import yaml

from bench.harness import Table, command_line, median, paired_ratios, percentiles, write_result
from bench.hicache_overhead import StandalonePool
from dsv4_idxk_probe import environment_variables as ev
from dsv4_idxk_probe.hicache.settings import RESTORE_RECORDS, parse_settings
from dsv4_idxk_probe.safety import error_counts
from dsv4_idxk_probe.testbed.builtin.modeltime import STEP_WAITS, step_wait

PAGE_TOKENS, ITEM_BYTES = 256, 8448  # SGLang's DSV4 index-K host pool: page slots, fp8 row bytes
VARIANTS = ("restore-off", "restore-on")  # the base first; pairs alternate which runs first
_METHODS = ("backup_from_device_all_layer", "load_to_device_per_layer", "backup_tokens_from_device_all_layer")


class ServingPool(StandalonePool):
    """The index-K host pool shape, random rows; its own class, so wrapping it leaves others alone."""

    def __init__(self, layers: int, host_pages: int, device_pages: int, device):
        super().__init__(device, layers=layers, host_pages=host_pages, device_pages=device_pages,
                         item_bytes=ITEM_BYTES, page_tokens=PAGE_TOKENS, name="deepseek_v4_c4_indexer", seed=11)


class Probed:
    """The adapter's wrappers on ServingPool, with one probe config (restore verification on or off)."""

    def __init__(self, restore: bool, work: Path, defer_ms: float | None = None, record: str | None = None):
        from prometheus_client import CollectorRegistry

        from dsv4_idxk_probe.config import load_config
        from dsv4_idxk_probe.metrics.definitions import ProbeMetrics

        config_file = work / f"hicache-serving-restore-{'on' if restore else 'off'}.yaml"
        section = {"restore_verify": restore}
        if defer_ms is not None:
            section["restore_defer_ms"] = defer_ms
        if record is not None:
            section["restore_record"] = record
        config_file.write_text(yaml.safe_dump({"hicache": section}))
        env = {ev.DSV4_IDXK_PROBE: "1", ev.DSV4_IDXK_PROBE_CONFIG: str(config_file)}
        self.registry = CollectorRegistry()
        self.runtime = SimpleNamespace(metrics=ProbeMetrics(self.registry), config=load_config(env),
                                       emit=lambda record: None, log=logging.getLogger("bench.hicache_serving"))
        self.handles: list = []

    def __enter__(self):
        import wrapt

        from dsv4_idxk_probe.sglang import hicache as adapter

        factories = (adapter.make_backup_wrapper, adapter.make_load_wrapper, adapter.make_backup_tokens_wrapper)
        for name, factory in zip(_METHODS, factories):
            self.handles.append((name, wrapt.wrap_function_wrapper(ServingPool, name, factory(self.runtime))))
        return self

    def __exit__(self, *exc):
        import wrapt

        from dsv4_idxk_probe.hicache import forget

        for name, handle in self.handles:
            if hasattr(wrapt, "unwrap_object"):
                wrapt.unwrap_object(ServingPool, name, handle)
            else:  # wrapt 1.x: the proxy keeps the original
                setattr(ServingPool, name, ServingPool.__dict__[name].__wrapped__)
        self.handles.clear()
        forget(self.runtime)  # drains the collectors, stops the flusher; the next run starts afresh

    def drain(self) -> None:
        from dsv4_idxk_probe.hicache import probe_for

        restore = probe_for(self.runtime).restore
        if restore is not None:
            restore.drain()

    def sample(self, name: str, labels: dict) -> float:
        total = 0.0
        for metric in self.registry.collect():
            for s in metric.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total


class Traffic:
    """Rooms on a ring of page groups: room r writes its prefix through from device group
    r to host group r; a restoring room first loads host group r-1 (the latest backup of
    those rows) into its device group. `streams`: (backup's, load's) CUDA streams, or
    none to copy on the current stream. On two streams, each copy first waits for the
    other stream's work so far: a load reads rows a backup wrote, a backup reads pages a
    load wrote (SGLang orders them by its acknowledgements; here the ring reuses them)."""

    def __init__(self, pool: ServingPool, groups: int, pages: int, device, streams: tuple = ()):
        def idx(first_page: int):
            return torch.arange(first_page * PAGE_TOKENS, (first_page + pages) * PAGE_TOKENS, dtype=torch.int64,
                                device=device)

        self.pool, self.groups = pool, groups
        self.host = [idx(g * pages) for g in range(groups)]
        self.dev = [idx(g * pages) for g in range(groups)]
        self.room = self.loads = 0
        self.backup_stream, self.load_stream = streams or (None, None)

    def admit(self, restore: bool) -> None:
        g = self.room % self.groups
        if restore and self.room:
            self.loads += 1
            prev = (self.room - 1) % self.groups
            with self._on(self.load_stream, self.backup_stream):
                for layer in range(self.pool.layer_num):
                    self.pool.load_to_device_per_layer(None, self.host[prev], self.dev[g], layer, "kernel")
        with self._on(self.backup_stream, self.load_stream):
            self.pool.backup_from_device_all_layer(None, self.host[g], self.dev[g], "kernel")
        self.room += 1

    @staticmethod
    def _on(stream, after):
        """Copy on `stream` (behind `after`'s work so far), or on the current stream."""
        if stream is None:
            return nullcontext()
        stream.wait_stream(after)
        return torch.cuda.stream(stream)


def one_run(args, traffic: Traffic, wait, sync) -> dict:
    """Serve for `target_seconds`: per model step, admit rooms (write-through, some restoring), then the step."""
    every = max(1, round(1 / args.restore_share)) if args.restore_share > 0 else 0
    rooms = steps = 0  # the run's own count decides which rooms restore: the same ones in every run
    loads_before = traffic.loads
    step_s = args.step_ms / 1e3
    host_ms, cpu_s = [], 0.0
    started = time.perf_counter()
    while time.perf_counter() - started < args.target_seconds:
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(args.rooms_per_step):
            traffic.admit(bool(every) and rooms % every == 0)
            rooms += 1
        cpu_s += time.thread_time() - c0
        host_ms.append(1e3 * (time.perf_counter() - t0))
        wait(step_s)
        steps += 1
    sync()
    elapsed = time.perf_counter() - started
    return {"rooms": rooms, "loads": traffic.loads - loads_before, "steps": steps, "seconds": elapsed,
            "rooms_per_s": rooms / elapsed,
            "admit_ms": percentiles(host_ms), "admit_cpu_us_per_room": 1e6 * cpu_s / max(1, rooms)}


def _event_waiter(streams: tuple) -> Callable[[], None]:
    """Wait for the work so far of the current stream and of `streams`, on this thread
    (events, not a device sync: no sync-debug trip)."""

    def wait() -> None:
        for stream in (torch.cuda.current_stream(), *streams):
            done = torch.cuda.Event()
            done.record(stream)
            done.synchronize()

    return wait


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--reps", type=int, default=7,
                   help="interleaved pairs: (off, on) in even pairs, (on, off) in odd ones (an even count balances them)")
    p.add_argument("--target-seconds", type=float, default=2.0, help="serving time per run")
    p.add_argument("--step-ms", type=float, default=10.0, help="model time per step")
    p.add_argument("--step-wait", choices=STEP_WAITS, default=None,
                   help="how the model time passes (default: gpu on CUDA, sleep on CPU)")
    p.add_argument("--rooms-per-step", type=int, default=2)
    p.add_argument("--restore-share", type=float, default=0.5, help="share of rooms that restore a prefix first")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--pages", type=int, default=16, help="pages per prefix (256 tokens each)")
    p.add_argument("--groups", type=int, default=8, help="page groups on the ring (host and device)")
    p.add_argument("--sync-debug", action="store_true",
                   help="CUDA: serve every timed run under torch.cuda.set_sync_debug_mode('error') (a sync on any "
                        "thread raises: on the serving thread the run fails, on a probe thread it is counted)")
    p.add_argument("--restore-defer-ms", type=float, default=None,
                   help="hicache.restore_defer_ms of the restore-on variant (default: the config's default)")
    p.add_argument("--restore-record", choices=RESTORE_RECORDS, default=None,
                   help="hicache.restore_record of the restore-on variant (default: the config's default)")
    p.add_argument("--copy-streams", choices=("sglang", "current"), default="sglang",
                   help="CUDA: copies on two streams of their own as SGLang's L2TransferEngine runs them (default), "
                        "or on the current stream, the model step's")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.step_wait is None:
        args.step_wait = "gpu" if args.device == "cuda" else "sleep"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(1)
    pool = ServingPool(args.layers, args.groups * args.pages, args.groups * args.pages, device)
    streams = ()
    if device.type == "cuda" and args.copy_streams == "sglang":
        streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))  # device-to-host, host-to-device
    traffic = Traffic(pool, args.groups, args.pages, device, streams)
    wait = step_wait(args.step_wait, device)
    sync = _event_waiter(streams) if device.type == "cuda" else (lambda: None)
    work = Path(tempfile.mkdtemp(prefix="hicache-serving-"))
    probes = {"restore-off": Probed(False, work), "restore-on": Probed(True, work, args.restore_defer_ms, args.restore_record)}
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for variant in VARIANTS:  # registers the pool, builds the digest engine, warms caches: not timed
        with probes[variant] as probed:
            for k in range(2 * args.groups):
                traffic.admit(k > 0)  # the first room only writes through: its rows' backups are this probe's
            sync()
            probed.drain()
    on = probes["restore-on"]
    verdicts = ("match", "mismatch", "unverified")

    def load_verdicts() -> dict[str, float]:
        return {v: on.sample("dsv4_idxk_probe_rooms_verified_total", {"stage": "hicache_load", "verdict": v})
                for v in verdicts}

    def unverified_bytes() -> float:
        return sum(on.sample("dsv4_idxk_probe_coverage_bytes_total", {"path": path, "outcome": "unverified"})
                   for path in ("hicache_backup", "hicache_load"))

    before, errors_before, unverified_before = load_verdicts(), sum(error_counts().values()), unverified_bytes()
    for rep in range(args.reps):
        for variant in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):  # off first, then on first: ABBA
            with probes[variant] as probed:
                traffic.admit(False)  # the run's first copy registers the pool anew (and its digests' store): untimed
                sync()
                probed.drain()
                if args.sync_debug and device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    run = one_run(args, traffic, wait, sync)
                finally:
                    if device.type == "cuda":
                        torch.cuda.set_sync_debug_mode(0)
                probed.drain()
            runs[variant].append(run)
        print(f"  pair {rep}: " + "  ".join(f"{v} {runs[v][-1]['rooms_per_s']:.1f} rooms/s" for v in VARIANTS),
              flush=True)
    after = load_verdicts()
    compared = {v: after[v] - before[v] for v in verdicts}
    errors = sum(error_counts().values()) - errors_before
    loads = sum(run["loads"] for run in runs["restore-on"])
    unverified = unverified_bytes() - unverified_before
    ratios = paired_ratios(runs, "rooms_per_s", "restore-off")["restore-on"]
    valid = (compared["match"] > 0 and compared["match"] == loads and not compared["mismatch"]
             and not compared["unverified"] and not unverified and not errors)
    report = {
        "command": command_line("hicache_serving", argv),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {"layers": args.layers, "pages_per_prefix": args.pages, "item_bytes": ITEM_BYTES,
                  "page_tokens": PAGE_TOKENS, "rooms_per_step": args.rooms_per_step,
                  "restore_share": args.restore_share, "step_ms": args.step_ms, "step_wait": args.step_wait,
                  "copy_streams": args.copy_streams if device.type == "cuda" else "cpu",
                  "restore_record": parse_settings(probes["restore-on"].runtime.config.hicache).restore_record},
        "runs": runs, "rooms_per_s_ratio": ratios, "restore_verdicts": compared, "restore_on_loads": loads,
        "restore_on_unverified_bytes": unverified, "probe_errors": errors, "valid": valid,
    }
    print(f"\nHiCache serving leg: device={report['device']} {args.layers} layers x {args.pages} pages per prefix, "
          f"{args.rooms_per_step} rooms per {args.step_ms:g} ms step ({args.step_wait}), restore share "
          f"{args.restore_share:g}, {args.reps} pairs of {args.target_seconds:g} s, copies on "
          f"{report['shape']['copy_streams']} streams")
    table = Table(("variant", "<12"), ("rooms/s median", "14.1f"), ("admit p50 ms", "12.3f"), ("admit p99 ms", "12.3f"),
                  ("thread CPU us/room", "18.1f"))
    print(table.header())
    for variant in VARIANTS:
        rs = runs[variant]
        print(table.row(variant, median(r["rooms_per_s"] for r in rs), median(r["admit_ms"]["p50"] for r in rs),
                        median(r["admit_ms"]["p99"] for r in rs), median(r["admit_cpu_us_per_room"] for r in rs)))
    print("rooms/s on/off per pair: " + ", ".join(f"{x:.3f}" for x in ratios["per_pair"])
          + f"; median {ratios['median']:.3f} (min {ratios['min']:.3f}, max {ratios['max']:.3f})")
    print(f"restore verdicts at hicache_load: {({k: int(v) for k, v in compared.items()})} of {loads} loads; "
          f"index-K bytes unverified {int(unverified)}; probe errors {int(errors)}; {'valid' if valid else 'INVALID'}")
    if args.out:
        write_result(args.out, "hicache_serving.json", report)
    return 0 if valid else 1


if __name__ == "__main__":
    sys.exit(main())
