"""The demo on SGLang's own servers: one pair, the shipped faults, the verdict per fault.

Each run gets its own folder (``probe-logs/demo-<time>/``): the probe config
both servers ran with, the servers' and router's logs, the probe's room logs
(``logs/``), the oracle's and injector's records (``rig/``), ``diff.json``,
``faults-applied.json`` and ``verification.json``.
"""

from __future__ import annotations

import json
import re
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ...background import every
from ..faults.summary import render, shipped_fault_spec
from ..faults.verify import as_json
from . import launch, workload
from .run import RigSession, check_fault_spec


@dataclass
class SGLangDemoOptions:
    rooms: int = 48
    seed: int = 0
    faults: str | None = None  # None: the shipped spec
    no_faults: bool = False
    log_dir: str = "probe-logs"
    step_interval: int = 4
    concurrency: int = 4
    overlap: bool = False


def run_dir_for(log_dir: str) -> Path:
    base = Path(log_dir) / time.strftime("demo-%Y%m%d-%H%M%S")
    run_dir, n = base, 1
    while run_dir.exists():
        n += 1
        run_dir = base.with_name(f"{base.name}.{n}")
    return run_dir


class NoProgress:
    """What `run_sglang_demo` reports progress to when nobody listens; the command line passes
    its own (`step(text)` around a blocking step, `count(done, total, unit, what=...)`)."""

    def step(self, text: str):
        return nullcontext()

    def count(self, done: int, total: int | None = None, unit: str = "", what: str = "") -> None:
        pass


@contextmanager
def watch_rooms(session: RigSession, total: int, progress: Any, every_s: float = 2.0):
    """While requests run, count the rooms decode has finished (the oracle's decode_finish
    records, written by the servers) and hand the count to `progress` every `every_s`."""
    def tell() -> None:
        try:
            done = len({o.get("room") for o in session._read("oracle") if o.get("stage") == "decode_finish"})
        except OSError:
            return
        progress.count(min(done, total), total, "rooms finished at decode", what="requests")

    try:
        with every(every_s, tell, name="dsv4-idxk-probe-demo-progress"):
            yield
    finally:
        tell()  # the last count, once the requests are done


def run_sglang_demo(opts: SGLangDemoOptions, out: TextIO, progress: Any = None) -> int:
    progress = progress or NoProgress()
    faults = None if opts.no_faults else str(opts.faults or shipped_fault_spec())
    options = launch.ServerOptions(overlap=opts.overlap)
    sizes = dict(rooms=opts.rooms, seed=opts.seed, concurrency=opts.concurrency)
    requests = workload.plan("demo", workload.fault_workload(faults, **sizes) if faults
                             else workload.WorkloadOptions(**sizes))
    if faults is not None:  # a bad spec is refused before any server starts: its fields, the model, the rooms
        check_fault_spec(faults, requests, options)
    run_dir = run_dir_for(opts.log_dir)
    print(f"dsv4-idxk-probe demo: SGLang's own PD servers ({'overlap' if opts.overlap else 'normal'} event loops),\n"
          f"  router and NIXL over UCX on loopback; the probe on through DSV4_IDXK_PROBE only", file=out)
    print(f"  {opts.rooms} requests, stand-in DeepSeek-V4 (C4 layers 1 and 3, fp8 index-K rows of 8448 B)", file=out)
    print(f"  faults: {faults or 'none'}", file=out)
    print(f"  run folder: {run_dir}", file=out, flush=True)
    session = RigSession(run_dir, options, probe_config=f"step_interval: {opts.step_interval}\n", seed=opts.seed)
    started = time.monotonic()
    print("  starting the prefill and decode servers and the router ...", file=out, flush=True)
    try:
        with progress.step("starting SGLang's prefill and decode servers and the router"):
            session.start()
        print(f"  up in {session.started_s:.0f}s: {session.cluster.url} (router), "
              f"{session.cluster.server_url('prefill')}, {session.cluster.server_url('decode')}", file=out, flush=True)
        print(f"  sending {len(requests)} requests, {opts.concurrency} at a time ...", file=out, flush=True)
        with watch_rooms(session, len(requests), progress):
            phase = session.phase("demo", requests, faults=faults, concurrency=opts.concurrency)
        metrics = probe_series(session.cluster.server_url("decode"))
    finally:
        session.stop()
    check = phase.verification
    records = phase.faults
    (run_dir / "faults-applied.json").write_text(json.dumps(records, indent=1))
    (run_dir / "verification.json").write_text(json.dumps(as_json(check), indent=1))
    ok_requests = sum(1 for o in phase.outcomes if o.status == 200)
    print(f"\n{ok_requests}/{len(requests)} requests answered in {phase.seconds:.1f}s; outputs as the stand-in "
          f"model predicts: {ok_requests - len(phase.wrong_outputs)}/{ok_requests}", file=out)
    if metrics:
        print(f"decode's SGLang /metrics carried {len(metrics)} dsv4_idxk_probe_* samples, e.g. (SGLang's "
              f"labels left out):", file=out)
        for line in metrics[:4]:
            print(f"  {without_sglang_labels(line)}", file=out)
    for problem in (phase.failed_requests + phase.unrecorded_faults)[:10]:
        print(f"  ! {problem}", file=out)
    applied = sum(1 for r in records if r["applied"])
    render(check, applied, out)
    print(f"\nwall time {time.monotonic() - started:.0f}s; logs and JSON: {run_dir}\n"
          f"diff again with: dsv4-idxk-probe diff {run_dir / 'logs'}", file=out)
    return 0 if phase.ok else 1


#: Labels SGLang puts on every series of its /metrics; the demo's samples are shown without them.
SGLANG_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "dp_rank")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)",?')


def without_sglang_labels(sample: str) -> str:
    """`name{labels} value` with SGLang's own labels dropped, so a sample fits a terminal line."""
    head, brace, rest = sample.partition("{")
    if not brace:
        return sample
    labels, _, value = rest.rpartition("}")
    kept = [f'{k}="{v}"' for k, v in _LABEL.findall(labels) if k not in SGLANG_LABELS]
    return f"{head}{{{','.join(kept)}}}{value}"


def probe_series(server_url: str) -> list[str]:
    """The probe's samples on a server's own /metrics (verdict counters first)."""
    try:
        status, body = launch.http_get(server_url + "/metrics", timeout=10.0)
    except OSError:
        return []
    if status != 200:
        return []
    lines = [l for l in body.decode("utf-8", "replace").splitlines() if l.startswith("dsv4_idxk_probe_")]
    return sorted(lines, key=lambda l: (not l.startswith("dsv4_idxk_probe_rooms_verified"), l))
