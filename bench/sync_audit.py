"""One sync audit for a GPU: every hook path of the probe on real CUDA tensors, under
``torch.cuda.set_sync_debug_mode("error")``; the run stops and fails at the first sync.

Why one entry point: the invariant "no host-device synchronisation on the
scheduler thread in the default mode" covers the PD hooks and the HiCache
host-pool hooks alike, and a pass must mean all of them passed in one run.

Steps, in order (a failing step ends the run; later steps are "not run"):
  1. pd hooks: bench/pd_hooks_sync_audit.py (prefill send_kv_chunk +
     sender.send; decode _send_kv_metadata, _commit_transfer_to_req =
     receive, process_batch_result_decode = step, and finish). It also
     checks verdicts and localisation.
  2. host-pool hooks, round-trip off: the adapter's wrappers
     (dsv4_idxk_probe.sglang.hicache) on bench/hicache_overhead.py's
     standalone pool, index checks on and off; the first call (which
     registers the pool), backup, per-layer load with the same and with new
     indices, and the token-granular backup (geometry guard, observe). Each
     call runs under step 1's guard: sync debug mode "error" plus tripwires
     on Event/Stream/device synchronize, which that mode does not see. The
     adapter swallows the probe's own exceptions (fail-open), so the audit
     also fails on any error the fail-open boundary recorded.
  3. host-pool CPU cost per call: bench/hicache_overhead.py --standalone
     (its own timed calls also run under sync debug mode "error").

Needs torch (and triton on CUDA), numpy, pyyaml, xxhash, prometheus_client
and wrapt; not sglang, pyzmq or nixl (the exchange is off, pools are
stand-ins holding real tensors).

Usage:  python3 -m bench.sync_audit --out DIR            (CUDA)
        python3 -m bench.sync_audit --cpu-smoke --out DIR (no GPU: the same flow, no sync checks)
Prints a short table last; writes sync_audit.json (and the steps' own JSON) under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import command_line, write_result


def load_bench(name: str):
    """A sibling bench script, imported when first needed (pd_hooks_sync_audit sets up
    its stand-in modules and tripwires as it is imported)."""
    return importlib.import_module(f"bench.{name}")


class Failures(logging.Handler):
    """Keeps the first exception the fail-open boundary logged, with its traceback."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.first: str | None = None

    def emit(self, record):
        if self.first is None and record.exc_info:
            self.first = self.format(record)


# %% steps


def _fail_fast(pdh) -> None:
    """Once the probe has failed, the script's later checks stop waiting for records that
    will never come (it would wait a minute per check): the run is failed already."""
    from dsv4_idxk_probe import safety

    before = sum(safety.error_counts().values())
    wait = pdh.Sink.wait

    def waiting(self, n, timeout=60.0, **match):
        return wait(self, n, 0.0 if sum(safety.error_counts().values()) != before else timeout, **match)

    pdh.Sink.wait = waiting


def step_pd_hooks(args) -> dict:
    pdh = load_bench("pd_hooks_sync_audit")
    _fail_fast(pdh)
    out = args.out if args.out is not None else Path(tempfile.mkdtemp(prefix="sync-audit-"))
    extra = (["--cpu-smoke"] if args.cpu_smoke else []) + (["--diagnosis"] if args.diagnosis else [])
    rc = pdh.main(["--rooms", str(args.rooms), "--layers", str(args.layers), "--out", str(out), *extra])
    written = out / "pd_hooks_sync_audit.json"
    detail = json.loads(written.read_text()) if written.exists() else {}
    ok = rc == 0
    summary = (f"{detail.get('rooms', '?')} rooms x {detail.get('layers', '?')} layers; probe errors "
               f"{detail.get('probe_errors', '?')}; faults localised {detail.get('faults_localised', '?')}/"
               f"{detail.get('faults', '?')}") if detail else f"exit {rc}"
    return {"ok": ok, "summary": summary, "exit": rc, "failures": detail.get("failures", [])}


def _copies(registry, direction: str, branch: str) -> int:
    total = 0
    for metric in registry.collect():
        if metric.name == "dsv4_idxk_probe_hicache_copies":
            for s in metric.samples:
                if s.name.endswith("_total") and s.labels.get("direction") == direction and s.labels.get("branch") == branch:
                    total += int(s.value)
    return total


def step_hostpool_hooks(args) -> dict:
    import torch

    from dsv4_idxk_probe import safety
    from dsv4_idxk_probe.diagnosis.journal import PageJournal
    from dsv4_idxk_probe.hicache import forget, probe_for

    pdh = load_bench("pd_hooks_sync_audit")  # its SyncGuard and tripwires
    hov = load_bench("hicache_overhead")
    pdh.SyncGuard.active = not args.cpu_smoke
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    pool = hov.StandalonePool(device)
    host, dev = hov.indices(0, device), hov.indices(8, device)
    fresh = [(hov.indices(i, device), hov.indices(8 + i, device)) for i in range(2)]
    token_host = torch.arange(100, dtype=torch.int64, device=device)  # not a page multiple: token path
    token_dev = token_host + 8 * hov.PAGE
    failures = Failures()
    logging.getLogger("dsv4_idxk_probe").addHandler(failures)
    logging.getLogger("bench.hicache").setLevel(logging.CRITICAL)  # the guard's stack logs, by design
    done, installed = {}, []
    try:
        for checks in (True, False):
            inst = hov.Installed(hov.StandalonePool, checks)
            if args.diagnosis:  # backups and loads become page-journal events
                inst.runtime.journal = PageJournal()
            installed.append(inst)
            before = sum(safety.error_counts().values())
            calls = 0
            with inst:
                for i in range(args.hp_calls):
                    with pdh.SyncGuard():
                        pool.backup_from_device_all_layer(None, host, dev, "kernel")
                        pool.load_to_device_per_layer(None, host, dev, 1, "kernel")
                        h, d = fresh[i & 1]
                        pool.load_to_device_per_layer(None, h, d, 2, "kernel")
                        with contextlib.suppress(ValueError):  # the stand-in pool refuses it after the hook ran
                            pool.backup_tokens_from_device_all_layer(token_host, token_dev)
                    calls += 4
                    if sum(safety.error_counts().values()) != before:
                        where = "index checks " + ("on" if checks else "off")
                        return {"ok": False, "summary": f"{where}, call group {i}: the probe failed (a sync?)",
                                "failures": [failures.first or "see stderr"]}
                inst.flush()  # the flusher's work, outside the guard (its own thread in production)
                probe_for(inst.runtime).publish()
            counted = {"backup": _copies(inst.registry, "d2h", "page"), "load": _copies(inst.registry, "h2d", "page"),
                       "token": _copies(inst.registry, "d2h", "token_dsv4_mla")}
            expect = {"backup": args.hp_calls, "load": 2 * args.hp_calls, "token": args.hp_calls}
            if counted != expect:  # the wrappers must really have run
                return {"ok": False, "summary": f"hooks did not count every call: {counted} != {expect}", "failures": []}
            done["checks on" if checks else "checks off"] = calls
    finally:
        logging.getLogger("dsv4_idxk_probe").removeHandler(failures)
        for inst in installed:
            forget(inst.runtime)  # stops each probe's flusher
    label = "no sync checks (cpu smoke)" if args.cpu_smoke else "zero syncs"
    return {"ok": True, "summary": f"{sum(done.values())} wrapped calls ({done}); {label}", "failures": []}


def step_hostpool_cost(args) -> dict:
    hov = load_bench("hicache_overhead")
    device = "cpu" if args.cpu_smoke else "cuda"
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        rc = hov.main(["--device", device, "--standalone", "--rounds", str(args.hp_rounds), "--calls", str(args.hp_cost_calls)])
    text = buffer.getvalue()
    print(text, end="")
    if args.out is not None:
        (args.out / "hicache_overhead.txt").write_text(text)
    worst = next((line for line in text.splitlines() if line.startswith("worst added")), "")
    # exit 2 means the 20 us CPU budget was exceeded: a cost finding, not a sync
    return {"ok": rc in (0, 2), "summary": worst or f"exit {rc}", "exit": rc, "over_budget": rc == 2,
            "failures": [] if rc in (0, 2) else [text[-2000:]]}


def inject_sync(where: str, cpu_smoke: bool) -> None:
    """Self-test: put one blocking read into the probe's own code; the audit must then fail."""
    import torch

    from dsv4_idxk_probe.digest.engine import DigestEngine
    from dsv4_idxk_probe.hicache.probe import HiCacheProbe

    owner, name = (DigestEngine, "submit") if where == "pd" else (HiCacheProbe, "begin")
    original = getattr(owner, name)

    def with_sync(self, *a, **k):
        if cpu_smoke:
            torch.cuda.synchronize()  # step 1's tripwire raises while a hook runs
        else:
            torch.ones(1, device="cuda").item()  # sync debug mode "error" raises
        return original(self, *a, **k)

    setattr(owner, name, with_sync)


STEPS = (("pd hooks", step_pd_hooks), ("host-pool hooks", step_hostpool_hooks), ("host-pool cost", step_hostpool_cost))


def main(argv_=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--cpu-smoke", action="store_true", help="no GPU: run every step on CPU tensors, without sync checks")
    p.add_argument("--rooms", type=int, default=64, help="rooms through the PD hooks")
    p.add_argument("--diagnosis", action="store_true",
                   help="diagnosis on (the probe's default; without this flag the audit runs verification alone): "
                        "its journal, snapshots and page-id copies are audited too")
    p.add_argument("--layers", type=int, default=30, help="C4 layers of the PD pools")
    p.add_argument("--hp-calls", type=int, default=200, help="call groups per host-pool variant")
    p.add_argument("--hp-rounds", type=int, default=5)
    p.add_argument("--hp-cost-calls", type=int, default=1000)
    p.add_argument("--inject-sync", choices=("pd", "hostpool"),
                   help="self-test: add a blocking read to the probe's pd or host-pool path; the run must FAIL")
    args = p.parse_args(argv_)
    import torch

    if args.inject_sync:
        load_bench("pd_hooks_sync_audit")  # its tripwires first
        inject_sync(args.inject_sync, args.cpu_smoke)

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("needs CUDA (or --cpu-smoke)", file=sys.stderr)
        return 2
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    failed = False
    for name, step in STEPS:
        if failed:
            results[name] = {"ok": None, "summary": "not run (an earlier step failed)", "failures": []}
            continue
        print(f"== {name}", flush=True)
        started = time.monotonic()
        results[name] = step(args)
        results[name]["seconds"] = round(time.monotonic() - started, 1)
        failed = not results[name]["ok"]
    report = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": "cpu (smoke: no sync checks)" if args.cpu_smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__, "python": platform.python_version(),
        "command": command_line("sync_audit", argv_),
        "steps": results, "passed": not failed, "injected_sync": args.inject_sync,
    }
    if args.out is not None:
        write_result(args.out, "sync_audit.json", report)
    print(f"\nsync audit on {report['device']}, torch {report['torch']}")
    print(f"{'step':<16} {'result':<8} {'s':>6}  detail")
    for name, r in results.items():
        # OVER: the step ran and found no sync, but its cost is over its budget (the audit's
        # verdict is about syncs; the row must not read PASS beside a figure over its budget)
        verdict = "-" if r["ok"] is None else ("FAIL" if not r["ok"] else "OVER" if r.get("over_budget") else "PASS")
        print(f"{name:<16} {verdict:<8} {r.get('seconds', 0):6.1f}  {r['summary']}")
        for f in r["failures"][:3]:
            print("   ", str(f).replace("\n", "\n    ")[:3000])
    over = [name for name, r in results.items() if r.get("over_budget")]
    print("RESULT:", "FAIL" if failed else "PASS" + (f" (no sync; over budget: {', '.join(over)})" if over else ""))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
