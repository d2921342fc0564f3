"""`dsv4-idxk-probe demo`: the local PD rig with injected faults, then the diff.

Exit status: 0 every injected fault was found where and when expected and
nothing else was reported; 1 the probe missed or invented something; 2 bad
input (fault spec, probe config, rig settings) or a rig failure; 3 an
internal error (`dsv4-idxk-probe --help` has the table for every command).
"""

from __future__ import annotations

import argparse
import sys

HELP = "run the local PD rig (two processes, real NIXL, injected faults) and show what the probe found"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--rooms", type=int, default=200, help="requests to run (200)")
    a("--layers", type=int, default=8, help="C4 layers, 1..61 (8)")
    a("--layout", default="fp8", help="index-K row layout: fp8, fp4, bf16 or one from configs/layouts.yaml (fp8)")
    a("--seed", type=int, default=0, help="seed for room lengths, prefixes, steps and random fault targets (0)")
    a("--faults", metavar="FILE", help="fault spec (docs/faults.md); default: the shipped configs/faults/demo.yaml")
    a("--no-faults", action="store_true", help="inject nothing: every room must match")
    a("--probe-config", metavar="FILE", help="probe config for both processes; default: one written into the run folder")
    a("--log-dir", default="probe-logs", help="parent of the run folder (./probe-logs)")
    a("--metrics-port", type=int, default=0, help="port for both processes' metrics (0: any free port; -1: none)")
    a("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where index-K buffers live (auto: cuda if present)")
    a("--prefill-gpu", type=int, default=0, help="CUDA device index of prefill's buffers (0)")
    a("--decode-gpu", type=int, default=0, help="CUDA device index of decode's buffers (0)")
    a("--pool-source", choices=("auto", "sglang", "builtin"), default="auto",
      help="who allocates the buffers: SGLang's DeepSeekV4IndexerPool when importable (auto), or the built-in copy")
    a("--max-running", type=int, default=16, help="rooms decode holds at once (16)")
    a("--step-interval", type=int, default=8, help="decode_step digest every N steps, in the written probe config (8)")
    a("--plain", action="store_true", help="plain progress lines instead of a live bar")


def main(args: argparse.Namespace) -> int:
    from ..config import ConfigError
    from ..digest.layout import LayoutError
    from ..sim.demo import DemoOptions, run_demo
    from ..sim.faults import FaultSpecError
    from ..sim.plan import PlanError
    from ..sim.rig import RigError

    opts = DemoOptions(
        rooms=args.rooms, layers=args.layers, layout=args.layout, seed=args.seed, faults=args.faults,
        no_faults=args.no_faults, probe_config=args.probe_config, log_dir=args.log_dir,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port, device=args.device,
        prefill_gpu=args.prefill_gpu, decode_gpu=args.decode_gpu, pool_source=args.pool_source,
        max_running=args.max_running, step_interval=args.step_interval, plain=True if args.plain else None,
    )
    try:
        return run_demo(opts)
    except (ConfigError, FaultSpecError, PlanError, LayoutError, RigError) as exc:
        print(f"dsv4-idxk-probe demo: {exc}", file=sys.stderr)
        return 2
