"""Requests that never get an answer, with the probe on and off, under the same load.

Why: SGLang-rig runs lost a few requests (decode waited for a KV transfer
that never came, prefill never saw the request) and the probe was on in those
runs. A guest that may drop a production request is the worst defect it can
have, so this counts, over thousands of requests, the requests without an
answer with the probe on and with it off.

Two SGLang rig pairs (prefill, decode, router) run side by side, one with
``DSV4_IDXK_PROBE=1`` and one with ``0`` (the rig's plugin, stand-in model and
CPU patches are loaded in both), and the same request plan is sent to both
alternately, so both see the same machine load at the same time. Each
request's fate is one of: answered, an HTTP error, or no answer within
`--timeout-s` (lost). For every lost request the servers' logs are searched
for its rid (the servers run with ``--log-requests``), and the router's log
for errors on its prefill leg: where the request got to.

Usage:  python -m bench.soak [--requests 5000] [--overlap] [--scribble] [--short|--long] [--out DIR]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import Table, command_line, write_result
from dsv4_idxk_probe.testbed.sglang import launch, workload
from dsv4_idxk_probe.testbed.sglang.run import RigSession

MODES = {"on": "1", "off": "0"}
SHAPES = {  # prompt tokens and new tokens (the stress shape: agentic tool calls)
    "short": dict(min_prompt=64, max_prompt=700, min_new_tokens=1, max_new_tokens=16),
    "long": dict(min_prompt=600, max_prompt=2900, min_new_tokens=8, max_new_tokens=40),
}


@dataclass
class Tally:
    """What became of one mode's requests."""

    answered: int = 0
    http_error: int = 0
    lost: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def add(self, outcome: workload.Outcome, timeout_s: float) -> None:
        self.seconds.append(outcome.seconds)
        if outcome.status == 200:
            self.answered += 1
        elif outcome.status is not None:
            self.http_error += 1
            self.errors.append(f"{outcome.request.rid}: HTTP {outcome.status} {outcome.error[:120]}")
        else:
            self.lost.append(outcome.request.rid)


def where_it_got(cluster: launch.Cluster, rid: str) -> dict[str, object]:
    """Which servers logged the request, and the router's errors that name its prefill leg."""
    seen = {}
    for name in ("prefill", "decode"):
        path = cluster.logs.get(name)
        text = path.read_text(errors="replace") if path and path.exists() else ""
        seen[name] = rid in text
    router = cluster.logs.get("router")
    lines = router.read_text(errors="replace").splitlines() if router and router.exists() else []
    seen["router_errors"] = [line[:300] for line in lines if re.search(r"(?i)prefill.*(error|fail)|(error|fail).*prefill", line)][-5:]
    return seen


def soak(args: argparse.Namespace, out_dir: Path) -> dict:
    shape = SHAPES[args.shape]
    plan = workload.plan(f"soak{args.seed}", workload.WorkloadOptions(
        rooms=args.requests, seed=args.seed, shared_prefix_share=0.25, **shape))
    options = launch.ServerOptions(overlap=args.overlap, extra_prefill=("--log-requests",),
                                   extra_decode=("--log-requests",))
    sessions = {mode: RigSession(out_dir / mode, options, probe_mode=flag, seed=args.seed) for mode, flag in MODES.items()}
    tallies = {mode: Tally() for mode in MODES}
    started = time.monotonic()
    try:
        for session in sessions.values():
            session.start()
            session._write_plan({r.rid: r.number for r in plan}, None, scribble_freed=args.scribble)
        done = [0]
        lock = threading.Lock()

        def progress(_outcome) -> None:
            with lock:
                done[0] += 1
                if done[0] % 100 == 0:
                    lost = {m: len(t.lost) for m, t in tallies.items()}
                    print(f"  {done[0]}/{2 * len(plan)} requests, {time.monotonic() - started:.0f} s, lost {lost}",
                          file=sys.stderr, flush=True)

        def run(mode: str) -> None:
            def record(outcome: workload.Outcome) -> None:
                tallies[mode].add(outcome, args.timeout_s)
                progress(outcome)

            workload.send(sessions[mode].cluster.url, plan, args.concurrency, timeout_s=args.timeout_s, on_done=record)

        threads = [threading.Thread(target=run, args=(mode,), name=f"soak-{mode}") for mode in MODES]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        where = {mode: {rid: where_it_got(sessions[mode].cluster, rid) for rid in tallies[mode].lost[:20]}
                 for mode in MODES}
    finally:
        for session in sessions.values():
            session.stop()
    return {
        "command": command_line("soak", args.argv), "shape": args.shape, "overlap": args.overlap, "scribble": args.scribble,
        "requests_per_mode": len(plan), "concurrency": args.concurrency, "timeout_s": args.timeout_s,
        "seconds": round(time.monotonic() - started, 1),
        "modes": {mode: {"answered": t.answered, "http_error": t.http_error, "lost": len(t.lost),
                         "lost_rids": t.lost, "errors": t.errors[:20], "where_lost": where[mode]}
                  for mode, t in tallies.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000, help="requests per mode (default 5000)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="short")
    parser.add_argument("--overlap", action="store_true", help="SGLang's overlap event loops")
    parser.add_argument("--scribble", action="store_true", help="decode zeroes freed pages (the rig's scribbling)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight per mode")
    parser.add_argument("--timeout-s", type=float, default=240.0,
                        help="a request without an answer this long is lost (SGLang's own bootstrap timeout is 300 s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="folder for the run (default: a temporary one) and soak.json")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="soak-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    result = soak(args, out_dir)
    table = Table(("mode", "<6"), ("answered", ">9"), ("http error", ">10"), ("lost", ">5"))
    print(f"{result['requests_per_mode']} {args.shape} requests per mode, overlap={args.overlap}, "
          f"scribble={args.scribble}, {result['seconds']} s")
    print(table.header())
    for mode, m in result["modes"].items():
        print(table.row(mode, m["answered"], m["http_error"], m["lost"]))
        for rid, where in m["where_lost"].items():
            print(f"  lost {rid}: {where}")
    write_result(out_dir, "soak.json", result)
    print(f"details: {out_dir / 'soak.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
