"""Is the probe free to leave on? Throughput and latency with it off and on, interleaved.

Two legs, each run in interleaved repetitions (A B A B ..., A B C A B C ...)
so drift on a shared machine hits every variant alike; every ratio is
against "off" measured in the same repetition:

1. The PD rig (``dsv4_idxk_probe.testbed.builtin``): two processes moving DSV4-shaped
   index-K pages over real NIXL, driven through `run_rig` exactly as the demo
   drives it. The probe is switched on the way an operator does it, through
   the children's environment: ``off`` leaves DSV4_IDXK_PROBE unset,
   ``observe`` sets DSV4_IDXK_PROBE=1 and DSV4_IDXK_PROBE_CONFIG (room log
   dir, step interval). No faults, no byte oracle (it is the rig's own
   checker, not the probe). Reported per run: rooms/s in the steady part
   (the first --warmup-frac of finished rooms excluded, so process start
   and one-time kernel loading are not counted as per-room cost) and over
   the whole span, and room latency (last chunk sent -> room finished on
   decode, timed by the parent at event arrival) percentiles. Every
   observe run must show every room matching at decode_finish in its room
   log, or the run counts as failed: a probe that did not run is not free.

2. HiCache host-pool copies. The rig has no host-pool leg, so round-trip
   mode is measured here on host-pool-shaped copies: a pool with the
   attributes and copy methods of SGLang's DeepSeekV4PagedHostPool (fp8
   index-K rows of 8448 B, one row per page per C4 layer), wrapped by the
   product's own adapter factories (dsv4_idxk_probe.sglang.hicache), with
   the probe config read through DSV4_IDXK_PROBE / DSV4_IDXK_PROBE_CONFIG.
   One cycle = a backup of --hp-pages pages over all layers, then the
   per-layer loads of the same pages (what a HiCache hit does). Variants:
   ``bare``, ``observe`` (round-trip off, index checks on: the default) and
   ``observe+roundtrip`` (a debugging mode that synchronises). On CUDA both
   row sets live in device memory (a device-side gather/scatter stands in
   for SGLang's copy kernel); the probe's per-call work does not read them
   except in round-trip mode.

Usage:  python3 -m bench.overhead --out DIR [--device cpu|cuda] [--reps 5]
Prints a short table last; writes overhead.json under --out. Exit status 0
when every run completed and every observe run verified its rooms.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml

from bench.harness import Table, command_line, median, paired_ratios, percentiles, ratio, write_result
from bench.hicache_overhead import StandalonePool
from dsv4_idxk_probe import environment_variables as ev
from dsv4_idxk_probe.testbed.builtin.modeltime import STEP_WAITS

# Rig variants: the probe config each one adds ("off": the probe not enabled).
# "observe-poll" tells the collector's two ways of waiting apart in one run.
# "observe" runs the defaults (diagnosis on: docs/diagnosis.md); "observe-nodiag" runs
# verification alone and "observe-diag" names diagnosis on explicitly, so
# off,observe-nodiag,observe-diag shows in one run what diagnosis costs on top of verification;
# "observe-pinned" with the kernel storing into pinned memory (no copies on the
# serving thread, more GPU time: digest.outputs in docs/configuration.md); "observe-nodefer" with the
# collector folding each batch as soon as its kernel is done (digest.collector_defer_ms 0);
# "observe-deferdone" with the collector's deferral after the batch's event wait, not before it
# (digest.collector_defer_at "done", the form before 2026-12-05).
RIG_VARIANTS = {"off": None, "observe": {}, "observe-poll": {"digest": {"collector_wait": "poll"}},
                "observe-diag": {"diagnosis": {"enabled": True}}, "observe-nodiag": {"diagnosis": {"enabled": False}},
                "observe-pinned": {"digest": {"outputs": "pinned"}},
                "observe-nodefer": {"digest": {"collector_defer_ms": 0}},
                "observe-deferdone": {"digest": {"collector_defer_at": "done"}}}
HP_VARIANTS = ("bare", "observe-norestore", "observe", "observe+roundtrip")  # observe: restore verification on (the default)
HP_PAGE_TOKENS = 256  # SGLang's slot_page_size for the DSV4 index-K host pool
HP_ITEM_BYTES = 8448  # fp8 index-K row: 64 x 128 B payload + 64 x 4 B scale


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="folder for overhead.json (and kept run logs with --keep-logs)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions of each variant (>= 5 for the table)")
    p.add_argument("--skip-rig", action="store_true")
    p.add_argument("--skip-hostpool", action="store_true")
    rig = p.add_argument_group("rig leg")
    rig.add_argument("--rooms", type=int, default=0, help="rooms per run; 0: calibrate from --target-seconds")
    rig.add_argument("--rig-variants", default="off,observe",
                     help=f"comma list, 'off' first, of {', '.join(RIG_VARIANTS)}: run interleaved, each against off")
    rig.add_argument("--target-seconds", type=float, default=3.0, help="steady seconds per run when calibrating")
    rig.add_argument("--warmup-frac", type=float, default=0.1, help="first finished rooms left out of the steady rate")
    rig.add_argument("--layers", type=int, default=8)
    rig.add_argument("--layout", default="fp8")
    rig.add_argument("--min-tokens", type=int, default=64)
    rig.add_argument("--max-tokens", type=int, default=4096)
    rig.add_argument("--min-steps", type=int, default=8)
    rig.add_argument("--max-steps", type=int, default=48)
    rig.add_argument("--max-running", type=int, default=16)
    rig.add_argument("--decode-step-ms", type=float, default=0.0,
                     help="model time per decode batch step (0: transport only, the worst case for the ratio)")
    rig.add_argument("--decode-step-wait", choices=STEP_WAITS, default="sleep",
                     help="how the model time passes: an idle sleep, a spin that releases the GIL, or a GPU "
                          "kernel waited for on an event, as a scheduler waits for its forward (CUDA only); "
                          "see dsv4_idxk_probe/testbed/builtin/modeltime.py")
    rig.add_argument("--step-interval", type=int, default=8, help="probe config step_interval (decode_step digests)")
    rig.add_argument("--prefill-gpu", type=int, default=0)
    rig.add_argument("--decode-gpu", type=int, default=0)
    rig.add_argument("--seed", type=int, default=0)
    rig.add_argument("--run-timeout", type=float, default=300.0)
    rig.add_argument("--keep-logs", action="store_true", help="keep each observe run's room log under --out")
    rig.add_argument("--profile-runs", action="store_true",
                     help="after the legs, one more observe run with the parts of every digest submit timed in "
                          "both children (not counted in any ratio); prints where a submit's time goes")
    hp = p.add_argument_group("host-pool leg")
    hp.add_argument("--hp-layers", type=int, default=30, help="C4 layers of the index-K host pool")
    hp.add_argument("--hp-pages", type=int, default=16, help="pages per backup / load")
    hp.add_argument("--hp-cycles", type=int, default=40, help="cycles per variant and repetition")
    args = p.parse_args(argv)
    args.rig_variants = tuple(v.strip() for v in args.rig_variants.split(",") if v.strip())
    if args.rig_variants[:1] != ("off",) or not set(args.rig_variants) <= set(RIG_VARIANTS) or len(args.rig_variants) < 2:
        p.error(f"--rig-variants must start with off and name at least one of {', '.join(list(RIG_VARIANTS)[1:])}, "
                f"got {','.join(args.rig_variants)}")
    return args


# %% rig leg


@dataclass
class Timeline:
    """When the parent saw each room's events (perf_counter seconds)."""

    sent: dict = field(default_factory=dict)
    received: dict = field(default_factory=dict)
    finished: dict = field(default_factory=dict)

    def __call__(self, event: tuple) -> None:
        if event[0] in ("sent", "received", "finished"):
            getattr(self, event[0])[event[2]] = time.perf_counter()

    def summary(self, warmup_frac: float) -> dict:
        done = sorted(self.finished.items(), key=lambda kv: kv[1])
        n = len(done)
        if n < 3 or not self.sent:
            return {"rooms": n, "steady_rooms_per_s": 0.0, "rooms_per_s": 0.0}
        w = min(n - 2, int(n * warmup_frac))
        t0 = done[w][1]
        steady = [room for room, t in done[w:]]
        latency = [1e3 * (self.finished[r] - self.sent[r]) for r in steady if r in self.sent]
        transfer = [1e3 * (self.received[r] - self.sent[r]) for r in steady if r in self.sent and r in self.received]
        return {
            "rooms": n,
            "steady_rooms_per_s": (n - 1 - w) / (done[-1][1] - t0),
            "rooms_per_s": n / (done[-1][1] - min(self.sent.values())),
            "latency_ms": percentiles(latency),
            "transfer_ms": percentiles(transfer),
        }


def rig_config(args, rooms: int):
    from dsv4_idxk_probe.testbed.builtin.config import RigConfig

    return RigConfig(
        rooms=rooms, layers=args.layers, layout=args.layout, seed=args.seed, min_tokens=args.min_tokens,
        max_tokens=args.max_tokens, min_steps=args.min_steps, max_steps=args.max_steps,
        max_running=args.max_running, device=args.device, prefill_gpu=args.prefill_gpu,
        decode_gpu=args.decode_gpu, pool_source="builtin", oracle=False, decode_step_ms=args.decode_step_ms,
        decode_step_wait=args.decode_step_wait,
    )


def rig_env(variant: str, run_dir: Path, step_interval: int):
    """What an operator sets on both pods: nothing (off), or the variable and a config file."""
    from dsv4_idxk_probe.testbed.builtin.config import RoleEnv
    from dsv4_idxk_probe.testbed.builtin.settings import child_env

    if RIG_VARIANTS[variant] is None:
        return RoleEnv()
    config = run_dir / "probe.yaml"
    config.write_text(yaml.safe_dump({"step_interval": step_interval, "roomlog": {"dir": str(run_dir / "logs")},
                                      **RIG_VARIANTS[variant]}))
    return RoleEnv(common=child_env(probe=True, config=str(config)))


def check_logs(log_dir: Path, rooms: int) -> dict:
    """What the probe wrote: per-stage verdict counts and bytes; ok when every room matched at finish."""
    from dsv4_idxk_probe.roomlog import expand_inputs, read_entries

    files = expand_inputs([str(log_dir)]) if log_dir.is_dir() else []
    counts: dict[str, dict[str, int]] = {}
    bad_lines = 0
    for entry in read_entries(files):
        if entry.record is None:
            bad_lines += 1
            continue
        r = entry.record
        stage = counts.setdefault(r.get("stage", "?"), {})
        stage[str(r.get("verdict"))] = stage.get(str(r.get("verdict")), 0) + 1
    finish_match = counts.get("decode_finish", {}).get("match", 0)
    sent = sum(counts.get("prefill_send", {}).values())
    return {
        "verdicts": counts,
        "bad_lines": bad_lines,
        "bytes": sum(f.stat().st_size for f in files),
        "ok": finish_match == rooms and sent == rooms and bad_lines == 0,
    }


def one_rig_run(args, variant: str, rooms: int, work: Path, tag: str) -> dict:
    from dsv4_idxk_probe.testbed.builtin.rig import run_rig

    run_dir = work / tag
    run_dir.mkdir(parents=True)
    timeline = Timeline()
    result = run_rig(rig_config(args, rooms), rig_env(variant, run_dir, args.step_interval), on_event=timeline,
                     timeout_s=args.run_timeout)
    out = {"variant": variant, "seconds_incl_start": result.seconds, **timeline.summary(args.warmup_frac)}
    out["completed"] = len(result.finished) == rooms
    out["loop"] = loop_costs(result.stats)
    out["decode_busy_tokens_per_s"] = out["loop"]["decode_busy_tokens_per_s"]
    if variant != "off":
        out["probe_log"] = check_logs(run_dir / "logs", rooms)
        if args.keep_logs and args.out is not None:
            import shutil

            shutil.copytree(run_dir / "logs", args.out / "rig-logs" / tag)
    return out


def loop_costs(stats: dict) -> dict:
    """Per decode batch: microseconds inside probe calls on the decode loop, and how late
    the model-time sleep woke up (the probe's threads holding the GIL); per room on prefill."""
    decode, prefill = stats.get("decode", {}), stats.get("prefill", {})
    batches, rooms = max(1, decode.get("batches", 0)), max(1, prefill.get("rooms_sent", 0))
    return {
        "decode_probe_us_per_batch": 1e6 * decode.get("probe_s", 0.0) / batches,
        "decode_sleep_late_us_per_batch": 1e6 * decode.get("sleep_late_s", 0.0) / batches,
        "decode_probe_calls_per_batch": decode.get("probe_calls", 0) / batches,
        "prefill_probe_us_per_room": 1e6 * prefill.get("probe_s", 0.0) / rooms,
        # Why a run is slower when the probe time alone does not say: fewer rooms per
        # batch (admission held back), or the loop's own work slower (GIL, caches).
        "prefill_phases": prefill.get("phases", {}),
        "decode_running_per_batch": decode.get("running_sum", 0) / batches,
        "decode_batch_ms": 1e3 * decode.get("loop_s", 0.0) / batches,
        "decode_busy_batch_ms": 1e-3 * decode.get("busy_batch_median_us", 0.0),  # median of the steady, busy batches
        "decode_busy_tokens_per_s": decode.get("busy_tokens_per_s", 0.0),  # decode throughput in the steady state
        "decode_rest_us_per_batch": 1e6 * (decode.get("loop_s", 0.0) - decode.get("probe_s", 0.0)
                                           - decode.get("slept_s", 0.0)) / batches,
        # The same in thread CPU: rest wall growing while rest CPU does not means the
        # loop waited (for the GIL, a lock, a syscall), not that it computed more.
        "decode_rest_cpu_us_per_batch": 1e6 * (decode.get("loop_cpu_s", 0.0) - decode.get("probe_cpu_s", 0.0)
                                               - decode.get("slept_cpu_s", 0.0)) / batches,
        "by_kind": {**decode.get("probe_by_kind", {}), **prefill.get("probe_by_kind", {})},
        "parts": {role: stats.get(role, {}).get("parts", {}) for role in ("decode", "prefill")},
    }


def run_rig_leg(args, work: Path) -> dict:
    rooms = args.rooms
    warmups = []
    probe_rooms = rooms or 48
    for variant in args.rig_variants:  # caches warm (Triton's kernel cache on CUDA); the off run calibrates
        run = one_rig_run(args, variant, probe_rooms, work, f"warmup-{variant}")
        warmups.append(run)
        print(f"  warm-up {variant:<12} {run['rooms']} rooms, {run['steady_rooms_per_s']:.1f} rooms/s", flush=True)
    if not rooms:
        rate = warmups[0]["steady_rooms_per_s"]
        rooms = int(min(20000, max(48, round(rate * args.target_seconds / (1 - args.warmup_frac)))))
        print(f"  calibrated: {rooms} rooms per run (~{args.target_seconds:.1f} s steady at {rate:.1f} rooms/s)", flush=True)
    runs: dict[str, list[dict]] = {v: [] for v in args.rig_variants}
    for rep in range(args.reps):
        for variant in args.rig_variants:
            run = one_rig_run(args, variant, rooms, work, f"rep{rep}-{variant}")
            runs[variant].append(run)
            lat, loop = run.get("latency_ms", {}), run["loop"]
            off = runs["off"][-1]["steady_rooms_per_s"]
            paired = ratio(run["steady_rooms_per_s"], off)
            print(f"  rep {rep} {variant:<12} {run['steady_rooms_per_s']:8.3f} rooms/s ({paired:.3f} of off)  latency p50 "
                  f"{lat.get('p50', float('nan')):7.2f} ms  p99 {lat.get('p99', float('nan')):7.2f} ms  "
                  f"decode loop per batch: probe {loop['decode_probe_us_per_batch']:6.1f} us, "
                  f"sleep late {loop['decode_sleep_late_us_per_batch']:6.1f} us, "
                  f"running {loop['decode_running_per_batch']:5.2f}, batch {loop['decode_batch_ms']:6.2f} ms "
                  f"(busy {loop['decode_busy_batch_ms']:6.2f}), "
                  f"rest {loop['decode_rest_us_per_batch']:7.1f} us (CPU {loop['decode_rest_cpu_us_per_batch']:7.1f})"
                  + ("" if variant == "off" else f"  log ok {run['probe_log']['ok']}"), flush=True)
        if args.out is not None:  # every finished rep kept: a leg cut by its time limit still leaves its pairs
            partial = {"rooms_per_run": rooms, "reps_done": rep + 1, "runs": runs,
                       "steady_rooms_per_s_ratio": paired_ratios(runs, "steady_rooms_per_s", "off")}
            write_result(args.out, "overhead.partial.json", partial, default=float)
    return {
        "rooms_per_run": rooms,
        "config": {k: getattr(args, k) for k in ("layers", "layout", "min_tokens", "max_tokens", "min_steps",
                                                  "max_steps", "max_running", "step_interval", "decode_step_ms", "decode_step_wait",
                                                  "warmup_frac", "seed")},
        "warmups": warmups,
        "runs": runs,
        "steady_rooms_per_s_ratio": paired_ratios(runs, "steady_rooms_per_s", "off"),
        "rooms_per_s_ratio": paired_ratios(runs, "rooms_per_s", "off"),
        "decode_busy_tokens_per_s_ratio": paired_ratios(runs, "decode_busy_tokens_per_s", "off"),
        "latency_p50_ratio": _latency_ratios(runs, "p50"),
        "latency_p99_ratio": _latency_ratios(runs, "p99"),
        "valid": all(r["completed"] for rs in runs.values() for r in rs)
        and all(r["probe_log"]["ok"] for v, rs in runs.items() if v != "off" for r in rs),
    }


def _latency_ratios(runs: dict, q: str) -> dict:
    flat = {v: [{"x": r["latency_ms"][q]} for r in rs] for v, rs in runs.items()}
    return paired_ratios(flat, "x", "off")


# %% host-pool leg


class HostPoolShape(StandalonePool):
    """What the adapter reads of SGLang's DeepSeekV4PagedHostPool (the DSV4 C4 index-K pool),
    with random rows; a subclass so that wrapping it leaves the shared stand-in alone."""

    def __init__(self, layers: int, host_pages: int, device_pages: int, device):
        super().__init__(device, layers=layers, host_pages=host_pages, device_pages=device_pages, item_bytes=HP_ITEM_BYTES,
                         page_tokens=HP_PAGE_TOKENS, name="deepseek_v4_c4_indexer", seed=7)


_HP_METHODS = ("backup_from_device_all_layer", "load_to_device_per_layer", "backup_tokens_from_device_all_layer")


class WrappedFor:
    """The adapter's wrappers on HostPoolShape for one variant, configured from the environment."""

    def __init__(self, variant: str, work: Path):
        from prometheus_client import CollectorRegistry

        from dsv4_idxk_probe.config import load_config
        from dsv4_idxk_probe.metrics.definitions import ProbeMetrics

        config_file = work / f"hostpool-{variant}.yaml"
        config_file.write_text(yaml.safe_dump({"hicache": {"roundtrip": variant == "observe+roundtrip",
                                                           "restore_verify": variant != "observe-norestore"}}))
        env = {ev.DSV4_IDXK_PROBE: "1", ev.DSV4_IDXK_PROBE_CONFIG: str(config_file)}
        self.registry = CollectorRegistry()
        self.records: list[dict] = []
        self.runtime = SimpleNamespace(
            metrics=ProbeMetrics(self.registry), config=load_config(env), emit=self.records.append,
            log=logging.getLogger("bench.overhead"),
        )
        self.handles: list = []

    def __enter__(self):
        import wrapt

        from dsv4_idxk_probe.sglang import hicache as adapter

        factories = (adapter.make_backup_wrapper, adapter.make_load_wrapper, adapter.make_backup_tokens_wrapper)
        for name, factory in zip(_HP_METHODS, factories):
            self.handles.append((name, wrapt.wrap_function_wrapper(HostPoolShape, name, factory(self.runtime))))
        return self

    def __exit__(self, *exc):
        import wrapt

        from dsv4_idxk_probe.hicache import forget

        for name, handle in self.handles:
            if hasattr(wrapt, "unwrap_object"):
                wrapt.unwrap_object(HostPoolShape, name, handle)
            else:  # wrapt 1.x: the proxy keeps the original
                setattr(HostPoolShape, name, HostPoolShape.__dict__[name].__wrapped__)
        self.handles.clear()
        forget(self.runtime)  # stops the flusher after its last flush; the next block starts afresh

    def restore_counts(self) -> dict[str, int]:
        """Verdicts of restore verification at hicache_load (a clean leg: matches only)."""
        out = {}
        for metric in self.registry.collect():
            if metric.name == "dsv4_idxk_probe_rooms_verified":
                for s in metric.samples:
                    if s.name.endswith("_total") and s.labels.get("stage") == "hicache_load" and s.value:
                        out[s.labels["verdict"]] = out.get(s.labels["verdict"], 0) + int(s.value)
        return out

    def roundtrip_counts(self) -> dict[str, int]:
        out = {}
        for metric in self.registry.collect():
            if metric.name == "dsv4_idxk_probe_hicache_roundtrip":
                for s in metric.samples:
                    if s.name.endswith("_total") and s.value:
                        key = f"{s.labels['leg']}:{s.labels['verdict']}"
                        out[key] = out.get(key, 0) + int(s.value)
        return out


def run_hostpool_leg(args, work: Path) -> dict:
    device = torch.device(args.device)
    pages = args.hp_pages
    groups = 8
    pool = HostPoolShape(args.hp_layers, host_pages=groups * pages + 1, device_pages=groups * pages + 1, device=device)

    def idx(first_page: int):
        return torch.arange(first_page * HP_PAGE_TOKENS, (first_page + pages) * HP_PAGE_TOKENS, dtype=torch.int64, device=device)

    sets = [(idx(1 + g * pages), idx(1 + ((g + 3) % groups) * pages)) for g in range(groups)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def cycle(k: int) -> None:
        host, dev = sets[k % groups]
        pool.backup_from_device_all_layer(None, host, dev, "kernel")
        for layer in range(args.hp_layers):
            pool.load_to_device_per_layer(None, host, dev, layer, "kernel")
        sync()

    wrapped = {v: WrappedFor(v, work) for v in HP_VARIANTS if v != "bare"}
    for variant in HP_VARIANTS:  # first calls register the pool and warm caches: not timed
        with wrapped[variant] if variant in wrapped else contextlib.nullcontext():
            for k in range(groups):
                cycle(k)
    runs: dict[str, list[dict]] = {v: [] for v in HP_VARIANTS}
    for rep in range(args.reps):
        for variant in HP_VARIANTS:
            times = []
            with wrapped[variant] if variant in wrapped else contextlib.nullcontext():
                for k in range(args.hp_cycles):
                    started = time.perf_counter()
                    cycle(k)
                    times.append(time.perf_counter() - started)
            ms = [1e3 * t for t in times]
            runs[variant].append({"cycles_per_s": len(times) / sum(times), "latency_ms": percentiles(ms)})
        print(f"  rep {rep} " + "  ".join(f"{v} {runs[v][-1]['cycles_per_s']:.1f}/s" for v in HP_VARIANTS), flush=True)
    restore = wrapped["observe"].restore_counts()
    counts = wrapped["observe+roundtrip"].roundtrip_counts()
    legs_matched = all(counts.get(f"{leg}:match", 0) > 0 for leg in ("d2h", "host", "h2d"))
    mismatches = sum(n for k, n in counts.items() if k.endswith(":mismatch"))
    return {
        "pool": {"layers": args.hp_layers, "pages_per_call": pages, "item_bytes": HP_ITEM_BYTES,
                 "page_tokens": HP_PAGE_TOKENS, "layout": "layer_first", "device": str(device),
                 "bytes_per_cycle": 2 * args.hp_layers * pages * HP_ITEM_BYTES},
        "cycles_per_rep": args.hp_cycles,
        "runs": runs,
        "cycles_per_s_ratio": paired_ratios(runs, "cycles_per_s", "bare"),
        "latency_p50_ratio": paired_ratios({v: [{"x": r["latency_ms"]["p50"]} for r in rs] for v, rs in runs.items()}, "x",
                                           "bare"),
        "roundtrip_counts": counts,
        "restore_counts": restore,
        "valid": legs_matched and mismatches == 0 and restore.get("match", 0) > 0 and not restore.get("mismatch"),
    }


# %% report


def environment(args) -> dict:
    env = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "command": command_line("overhead"),
        "python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
        "device": args.device,
    }
    if args.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(args.prefill_gpu)
    return env


def print_tables(report: dict) -> None:
    rig = report.get("rig")
    if rig:
        print(f"\nPD rig, {rig['rooms_per_run']} rooms/run, {report['reps']} interleaved reps, device {report['env']['device']}"
              f" ({'valid' if rig['valid'] else 'INVALID: see JSON'})")
        table = Table(("variant", "<12"), ("steady rooms/s", "15.1f"), ("ratio", "7.3f"), ("[min, max]", ">15"),
                      ("p50 ms", "8.2f"), ("p90 ms", "8.2f"), ("p99 ms", "8.2f"), ("p99 ratio", "9.3f"),
                      ("busy tok/s", "10.0f"), ("ratio", "7.3f"), ("[min, max]", ">15"))
        print(table.header())
        for variant, runs in rig["runs"].items():
            rate = median(r["steady_rooms_per_s"] for r in runs)
            tokens = median(r["decode_busy_tokens_per_s"] for r in runs)
            lat = {q: median(r["latency_ms"][q] for r in runs) for q in ("p50", "p90", "p99")}
            r = rig["steady_rooms_per_s_ratio"].get(variant)
            t = rig["decode_busy_tokens_per_s_ratio"].get(variant)
            p99 = rig["latency_p99_ratio"].get(variant)
            span = f"[{r['min']:.3f}, {r['max']:.3f}]" if r else ""
            tspan = f"[{t['min']:.3f}, {t['max']:.3f}]" if t else ""
            print(table.row(variant, rate, r["median"] if r else 1.0, span, lat["p50"], lat["p90"], lat["p99"],
                            p99["median"] if p99 else 1.0, tokens, t["median"] if t else 1.0, tspan))
        print("busy tok/s: decode tokens per second over the steady decode batches; unlike rooms/s it does not "
              "count whole rooms, each ~1% of a run's rate")
        print("median per run: decode loop probe us/batch, decode sleep late us/batch, prefill probe us/room, "
              "rooms running per batch, decode batch ms, busy-batch median ms, decode loop rest us/batch (wall, CPU)")
        for variant, runs in rig["runs"].items():
            loop = {k: median(r["loop"][k] for r in runs) for k, v in runs[0]["loop"].items()
                    if isinstance(v, (int, float))}
            kinds = sorted({k for r in runs for k in r["loop"]["by_kind"]})
            per_call = "  ".join(
                f"{k} median {median(r['loop']['by_kind'][k]['median_us'] for r in runs if k in r['loop']['by_kind']):.0f} us"
                f" mean {median(1e6 * r['loop']['by_kind'][k]['total_s'] / r['loop']['by_kind'][k]['calls'] for r in runs if k in r['loop']['by_kind']):.0f} us"
                f" cpu {median(r['loop']['by_kind'][k]['cpu_median_us'] for r in runs if k in r['loop']['by_kind']):.0f} us"
                for k in kinds)
            print(f"{variant:<12} {loop['decode_probe_us_per_batch']:8.1f} {loop['decode_sleep_late_us_per_batch']:8.1f} "
                  f"{loop['prefill_probe_us_per_room']:8.1f} {loop['decode_running_per_batch']:6.2f} "
                  f"{loop['decode_batch_ms']:7.2f} {loop['decode_busy_batch_ms']:7.2f} "
                  f"{loop['decode_rest_us_per_batch']:8.1f} {loop['decode_rest_cpu_us_per_batch']:8.1f}  {per_call}")
            phases = sorted({k for r in runs for k in r["loop"].get("prefill_phases", {})})
            if phases:  # prefill's own work per call, wall and thread CPU: what grows with the probe on
                print(f"{'':<10} prefill " + "  ".join(
                    f"{k} {median(r['loop']['prefill_phases'][k]['median_us'] for r in runs if k in r['loop']['prefill_phases']):.0f} us"
                    f" (cpu {median(r['loop']['prefill_phases'][k]['cpu_median_us'] for r in runs if k in r['loop']['prefill_phases']):.0f})"
                    for k in phases))
    hp = report.get("hostpool")
    if hp:
        pool = hp["pool"]
        print(f"\nHost-pool copies ({pool['layers']} layers x {pool['pages_per_call']} pages x {pool['item_bytes']} B, backup + "
              f"per-layer loads per cycle, device {pool['device']}; {'valid' if hp['valid'] else 'INVALID'}; "
              f"round trip {hp['roundtrip_counts']})")
        table = Table(("variant", "<18"), ("cycles/s", "9.1f"), ("ratio", "7.3f"), ("[min, max]", ">15"), ("p50 ms", "8.2f"),
                      ("p99 ms", "8.2f"))
        print(table.header())
        for variant, runs in hp["runs"].items():
            rate = median(r["cycles_per_s"] for r in runs)
            p50 = median(r["latency_ms"]["p50"] for r in runs)
            p99 = median(r["latency_ms"]["p99"] for r in runs)
            r = hp["cycles_per_s_ratio"].get(variant)
            span = f"[{r['min']:.3f}, {r['max']:.3f}]" if r else ""
            print(table.row(variant, rate, r["median"] if r else 1.0, span, p50, p99))


def profile_observe_run(args, work: Path, rooms: int) -> dict:
    """One more observe run (not in any ratio) with the parts of every digest submit timed
    inside both children; print where a submit's time goes in a serving process."""
    from dsv4_idxk_probe.testbed.builtin.child import PART_TIMES_ENV

    os.environ[PART_TIMES_ENV] = "1"
    try:
        run = one_rig_run(args, "observe", rooms, work, "profiled")
    finally:
        os.environ.pop(PART_TIMES_ENV, None)
    print(f"\nsubmit parts inside the rig's processes ({rooms} rooms, one observe run, not in the ratios):")
    for role, parts in run["loop"]["parts"].items():
        for label, p in parts.items():
            print(f"  {role:<8} {label:<62} calls {p['calls']:6d}  median {p['median_us']:8.1f} us  mean {p['mean_us']:8.1f} us")
    return run


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible", file=sys.stderr)
        return 2
    for name in (ev.DSV4_IDXK_PROBE, ev.DSV4_IDXK_PROBE_CONFIG, ev.DSV4_IDXK_PROBE_FAULTS):
        os.environ.pop(name, None)  # "off" means unset in the children, whatever this shell had
    torch.set_num_threads(1)
    report: dict = {"env": environment(args), "reps": args.reps}
    with tempfile.TemporaryDirectory(prefix="idxk-overhead-") as tmp:
        work = Path(tmp)
        if not args.skip_rig:
            print(f"PD rig leg ({' / '.join(args.rig_variants)}, interleaved):", flush=True)
            report["rig"] = run_rig_leg(args, work)
        if not args.skip_hostpool:
            print(f"host-pool leg ({' / '.join(HP_VARIANTS)}, interleaved):", flush=True)
            report["hostpool"] = run_hostpool_leg(args, work)
        if args.profile_runs:
            report["profiled_run"] = profile_observe_run(args, work, report.get("rig", {}).get("rooms_per_run") or args.rooms or 80)
    if args.out is not None:
        write_result(args.out, "overhead.json", report, default=float)
    print_tables(report)
    valid = all(leg["valid"] for leg in (report.get("rig"), report.get("hostpool")) if leg)
    return 0 if valid else 1


if __name__ == "__main__":
    sys.exit(main())
