"""`dsv4-idxk-probe demo`: the local PD rig with injected faults, then the diff.

Exit status: 0 every injected fault was found where and when expected and
nothing else was reported; 1 the probe missed or invented something; 2 bad
input (fault spec, probe config, rig settings) or a rig failure; 3 an
internal error (`dsv4-idxk-probe --help` has the table for every command).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from ..offline.argtypes import whole_number

HELP = "run SGLang's PD servers here with injected faults and show what the probe finds (make demo)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--rig", choices=("sglang", "builtin"), default="sglang",
      help="sglang: SGLang 0.5.23's launch_server prefill and decode plus its router (default); "
           "builtin: the probe's own two-process rig (GPU benchmarks, fast tests)")
    a("--overlap", action="store_true", help="sglang rig: SGLang's overlap event loops instead of the normal ones")
    a("--concurrency", type=whole_number(1, 1024), default=4, help="sglang rig: requests in flight at once (4)")
    a("--rooms", type=whole_number(1, 1_000_000), default=None, help="requests to run (sglang rig 48, builtin 200)")
    a("--layers", type=whole_number(1, 61), default=8, help="C4 layers, 1..61 (8)")
    a("--layout", default="fp8", help="index-K row layout: fp8, fp4, bf16 or one from configs/layouts.yaml (fp8)")
    a("--seed", type=whole_number(0, 2**32 - 1), default=0, help="seed for room lengths, prefixes, steps and random fault targets (0)")
    a("--faults", metavar="FILE", help="fault spec (docs/faults.md); default: the shipped configs/faults/demo.yaml")
    a("--no-faults", action="store_true", help="inject nothing: every room must match")
    a("--probe-config", metavar="FILE", help="probe config for both processes; default: one written into the run folder")
    a("--log-dir", default="probe-logs", help="parent of the run folder (./probe-logs)")
    a("--metrics-port", type=whole_number(-1, 65535), default=0, help="port for both processes' metrics (0: any free port; -1: none)")
    a("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where index-K buffers live (auto: cuda if present)")
    a("--prefill-gpu", type=whole_number(0, 1023), default=0, help="CUDA device index of prefill's buffers (0)")
    a("--decode-gpu", type=whole_number(0, 1023), default=0, help="CUDA device index of decode's buffers (0)")
    a("--pool-source", choices=("auto", "sglang", "builtin"), default="auto",
      help="who allocates the buffers: SGLang's DeepSeekV4IndexerPool when importable (auto), or the built-in copy")
    a("--max-running", type=whole_number(1, 1_000_000), default=16, help="rooms decode holds at once (16)")
    a("--step-interval", type=whole_number(0, 1_000_000), default=None,
      help="decode_step digest every N decode batches (sglang rig) or steps (builtin), in the written probe config (4 / 8)")
    a("--plain", action="store_true", help="plain progress lines instead of a live bar")


def missing_extra() -> str | None:
    """Why the demo cannot run in this install: NIXL is the `[demo]` extra's, not a dependency."""
    if importlib.util.find_spec("nixl") is None:
        return ("the demo moves the KV over real NIXL, which is not installed: "
                "pip install 'dsv4-idxk-probe[demo]' (make demo installs it)")
    return None


def main(args: argparse.Namespace) -> int:
    missing = missing_extra()
    if missing:
        print(f"dsv4-idxk-probe demo: {missing}", file=sys.stderr)
        return 2
    if args.rig == "sglang":
        return _sglang(args)
    return _builtin(args)


def _sglang(args: argparse.Namespace) -> int:
    from ..testbed.faults.spec import FaultSpecError

    try:
        from ..testbed.sglang.demo import SGLangDemoOptions, run_sglang_demo
        from ..testbed.sglang.launch import LaunchError
    except ImportError as exc:
        print(f"dsv4-idxk-probe demo: the SGLang rig needs SGLang 0.5.23 and its server packages "
              f"(make demo installs them): {exc}", file=sys.stderr)
        return 2
    opts = SGLangDemoOptions(
        rooms=48 if args.rooms is None else args.rooms, seed=args.seed, faults=args.faults, no_faults=args.no_faults, log_dir=args.log_dir,
        step_interval=4 if args.step_interval is None else args.step_interval, concurrency=args.concurrency, overlap=args.overlap,
    )
    from .progress import Progress

    try:
        with Progress("demo") as progress:
            return run_sglang_demo(opts, sys.stdout, progress)
    except FaultSpecError as exc:
        print(f"dsv4-idxk-probe demo: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(f"dsv4-idxk-probe demo: {exc}", file=sys.stderr)
        return 2


def _builtin(args: argparse.Namespace) -> int:
    from ..config import ConfigError
    from ..digest.layout import LayoutError
    from ..testbed.builtin.demo import DemoOptions, run_demo
    from ..testbed.faults.spec import FaultSpecError
    from ..testbed.faults.plan import PlanError
    from ..testbed.builtin.rig import RigError

    opts = DemoOptions(
        rooms=200 if args.rooms is None else args.rooms, layers=args.layers, layout=args.layout, seed=args.seed, faults=args.faults,
        no_faults=args.no_faults, probe_config=args.probe_config, log_dir=args.log_dir,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port, device=args.device,
        prefill_gpu=args.prefill_gpu, decode_gpu=args.decode_gpu, pool_source=args.pool_source,
        max_running=args.max_running, step_interval=8 if args.step_interval is None else args.step_interval, plain=True if args.plain else None,
    )
    try:
        return run_demo(opts)
    except (ConfigError, FaultSpecError, PlanError, LayoutError, RigError) as exc:
        print(f"dsv4-idxk-probe demo: {exc}", file=sys.stderr)
        return 2
