"""The local PD rig with index-K buffers in VRAM: verdicts, rooms/s, transfer throughput.

Runs the same two processes as `dsv4-idxk-probe demo` (prefill and decode,
NIXL WRITE with completion notifications, the probe switched on through
DSV4_IDXK_PROBE), but with each side's buffers on a CUDA device, so NIXL
registers VRAM and the probe digests with its Triton kernel. Prefill and
decode may sit on different GPUs (--prefill-gpu / --decode-gpu). SGLang is
not needed: the buffers come from the rig's built-in copy of its allocator.

    python -m bench.rig_gpu                                 # 500 rooms, shipped faults, one GPU
    python -m bench.rig_gpu --decode-gpu 1                  # prefill on GPU 0, decode on GPU 1
    python -m bench.rig_gpu --no-faults --no-oracle --rooms 2000 --max-tokens 16384   # throughput

Prints a block to paste into bench/RESULTS.md. Exit status: 0 when every
injected fault was found where expected and nothing else was reported.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.harness import command_line


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rooms", type=int, default=500)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--layout", default="fp8")
    p.add_argument("--min-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--min-steps", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=48)
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--step-interval", type=int, default=8)
    p.add_argument("--prefill-gpu", type=int, default=0)
    p.add_argument("--decode-gpu", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", help="fault spec (default: the shipped configs/faults/demo.yaml)")
    p.add_argument("--no-faults", action="store_true")
    p.add_argument("--no-oracle", action="store_true", help="skip the byte-level oracle (it copies rows to the host)")
    p.add_argument("--serial-writes", action="store_true",
                   help="prefill waits for each WRITE before going on: exact per-WRITE bandwidth, slower rooms/s")
    p.add_argument("--cpu", action="store_true", help="host buffers instead (a baseline on the same machine)")
    p.add_argument("--log-dir", help="where room logs go (default: a temporary folder)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import torch

    from dsv4_idxk_probe.testbed.faults.summary import shipped_fault_spec
    from dsv4_idxk_probe.testbed.builtin.config import RigConfig, RoleEnv
    from dsv4_idxk_probe.testbed.builtin.rig import run_rig
    from dsv4_idxk_probe.testbed.builtin.settings import child_env
    from dsv4_idxk_probe.testbed.faults.verify import verify

    args = parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible; use --cpu for a host-memory baseline", file=sys.stderr)
        return 2
    log_root = Path(args.log_dir or tempfile.mkdtemp(prefix="rig-gpu-"))
    log_root.mkdir(parents=True, exist_ok=True)
    config = log_root / "probe.yaml"
    config.write_text(yaml.safe_dump({"step_interval": args.step_interval, "roomlog": {"dir": str(log_root / "logs")}}))
    faults = None if args.no_faults else (args.faults or str(shipped_fault_spec()))
    cfg = RigConfig(
        rooms=args.rooms, layers=args.layers, layout=args.layout, seed=args.seed, min_tokens=args.min_tokens,
        max_tokens=args.max_tokens, min_steps=args.min_steps, max_steps=args.max_steps, max_running=args.max_running,
        device=device, prefill_gpu=args.prefill_gpu, decode_gpu=args.decode_gpu, pool_source="builtin",
        oracle=not args.no_oracle, serial_writes=args.serial_writes,
    )
    env = RoleEnv(common=child_env(probe=True, config=str(config), faults=faults))
    marks: dict[str, float] = {}
    result_rooms: set[int] = set()

    def on_event(event):
        now = time.monotonic()
        if event[0] == "sent":
            marks.setdefault("first_sent", now)
            marks["last_sent"] = now
        elif event[0] == "received":
            marks["last_received"] = now
        elif event[0] == "finished":
            marks["last_finished"] = now
            finished = len(result_rooms) + 1
            result_rooms.add(event[2])
            if finished % 100 == 0:
                print(f"  {finished} rooms verified", flush=True)

    result = run_rig(cfg, env, on_event=on_event, timeout_s=3600)
    check = verify(log_root / "logs", result.faults, result.oracle, [p.room for p in cfg.room_plan()])
    stats = result.stats.get("prefill", {})
    span = marks.get("last_finished", 0) - marks.get("first_sent", 0)
    xfer_span = marks.get("last_received", 0) - marks.get("first_sent", 0)
    moved = stats.get("bytes", 0)
    names = sorted({torch.cuda.get_device_name(i) for i in {args.prefill_gpu, args.decode_gpu}}) if device == "cuda" else ["host"]
    applied = [c for c in check.checks if c.record["applied"]]
    lines = [
        f"### rig_gpu {time.strftime('%Y-%m-%d %H:%M')} on {', '.join(names)}",
        f"command: {command_line('rig_gpu', argv)}",
        f"rooms {len(result.finished)}/{cfg.rooms}, {cfg.layers} C4 layers, {cfg.layout} rows; prefill "
        f"{result.info['prefill']['device']}, decode {result.info['decode']['device']}; probe digests with "
        f"{'Triton on the GPU' if device == 'cuda' else 'the NumPy reference'}",
        f"rooms/s {len(result.finished) / max(span, 1e-9):.1f} (first send to last verdict {span:.2f} s; whole run "
        f"{result.seconds:.1f} s incl. process start)",
        f"transfer {moved / 1e9:.3f} GB in {stats.get('writes', 0)} NIXL WRITEs: {moved / max(xfer_span, 1e-9) / 1e9:.2f} GB/s "
        f"aggregate (first send to last receipt), mean {1e3 * stats.get('transfer_seconds', 0) / max(stats.get('rooms_sent', 1), 1):.2f} ms "
        f"post-to-complete per room"
        + (f"; per WRITE {moved / max(stats.get('write_seconds', 0), 1e-9) / 1e9:.2f} GB/s while in flight "
           f"({stats.get('write_seconds', 0):.3f} s in WRITEs)" if args.serial_writes else ""),
        f"diff: rooms by worst stage {json.dumps(check.verdicts, sort_keys=True)}; first divergences and per-stage counts in "
        f"{check.diff_json}",
        f"faults: {sum(c.ok for c in applied)}/{len(applied)} found where and when expected; unexplained mismatches "
        f"{len(check.unexplained)}; probe vs oracle {check.oracle_checked - len(check.oracle_disagreements)}/{check.oracle_checked}",
    ]
    print("\n".join(lines))
    for line in (check.unexplained + check.oracle_disagreements)[:10]:
        print(f"  ! {line}")
    for c in applied:
        if not c.ok:
            print(f"  ! {c.label} room {c.record['room']}: {c.note}")
    return 0 if check.ok else 1


if __name__ == "__main__":
    sys.exit(main())
