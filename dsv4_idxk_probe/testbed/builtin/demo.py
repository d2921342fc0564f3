"""The demo: one rig run with injected faults, then the diff and the verdict on the probe.

Each run gets its own folder under the log directory (``probe-logs/demo-
<time>/``) holding the probe config the children ran with, both sides' room
logs, the diff's JSON and the verification, so runs never mix.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import yaml

from ...digest import get_layout
from .config import RigConfig, RoleEnv
from .progress import RigProgress
from .rig import check_inputs, run_rig
from .settings import child_env
from ..faults.summary import render, shipped_fault_spec
from ..faults.verify import as_json, verify


@dataclass
class DemoOptions:
    rooms: int = 200
    layers: int = 8
    layout: str = "fp8"
    seed: int = 0
    faults: str | None = None  # None: the shipped example spec
    no_faults: bool = False
    probe_config: str | None = None  # None: one written into the run folder
    log_dir: str = "probe-logs"
    metrics_port: int | None = 0
    device: str = "auto"
    prefill_gpu: int = 0
    decode_gpu: int = 0
    pool_source: str = "auto"
    max_running: int = 16
    step_interval: int = 8
    plain: bool | None = None


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def prepare(opts: DemoOptions) -> tuple[Path, RigConfig, RoleEnv, str | None]:
    """Make the run folder, write the probe config, and build the rig's config and env."""
    run_dir = Path(opts.log_dir) / time.strftime("demo-%Y%m%d-%H%M%S")
    suffix = 1
    while run_dir.exists():
        suffix += 1
        run_dir = run_dir.with_name(f"{run_dir.name.split('.')[0]}.{suffix}")
    run_dir.mkdir(parents=True)
    config = opts.probe_config
    if config is None:
        config = str(run_dir / "probe.yaml")
        Path(config).write_text(yaml.safe_dump({
            "step_interval": opts.step_interval,
            "roomlog": {"dir": str(run_dir.resolve())},
            "diagnosis": {"enabled": True},  # the demo prints what each fault's bytes became
        }))
    faults = None if opts.no_faults else (opts.faults or str(shipped_fault_spec()))
    cfg = RigConfig(
        rooms=opts.rooms, layers=opts.layers, layout=opts.layout, seed=opts.seed, device=resolve_device(opts.device),
        prefill_gpu=opts.prefill_gpu, decode_gpu=opts.decode_gpu, pool_source=opts.pool_source,
        max_running=opts.max_running,
    )
    return run_dir, cfg, RoleEnv(common=child_env(probe=True, config=config, faults=faults)), faults


def run_demo(opts: DemoOptions, out: TextIO | None = None) -> int:
    """0: every fault found where expected and nothing else; 1: the probe missed or invented something.

    Bad input raises (ConfigError, FaultSpecError, PlanError, LayoutError) before anything starts.
    """
    out = out or sys.stdout
    run_dir, cfg, env, faults = prepare(opts)
    try:
        cfg = cfg.validated()
        check_inputs(cfg, env)
    except Exception:
        shutil.rmtree(run_dir, ignore_errors=True)  # only what prepare() just made
        raise
    layout = get_layout(cfg.layout)
    print(f"dsv4-idxk-probe demo: {cfg.rooms} rooms, {cfg.layers} C4 layers, {layout.name} rows of "
          f"{layout.row_bytes} B, device {cfg.device}, NIXL WRITE over UCX on loopback", file=out)
    print(f"  faults: {faults or 'none'}", file=out)
    print(f"  run folder: {run_dir}", file=out, flush=True)
    with RigProgress(cfg.rooms, out, plain=opts.plain) as progress:
        def on_event(event: tuple) -> None:
            if event[0] == "metrics":
                progress.write(f"  metrics: {event[2]}")
            elif event[0] == "ready":
                info = event[2]
                progress.write(f"  {event[1]}: {info['pages']} pages per layer on {info['device']}, "
                               f"buffers from {'SGLang DeepSeekV4IndexerPool' if info['pool_source'] == 'sglang' else 'the built-in allocator'}")
            progress.on_event(event)

        result = run_rig(cfg, env, on_event=on_event, metrics_port=opts.metrics_port)
    applied = [f for f in result.faults if f["applied"]]
    (run_dir / "faults-applied.json").write_text(json.dumps(result.faults, indent=1))
    check = verify(result.log_dir or run_dir, result.faults, result.oracle, [p.room for p in cfg.room_plan()])
    (run_dir / "verification.json").write_text(json.dumps(as_json(check), indent=1))
    stats = result.stats.get("prefill", {})
    rate = len(result.finished) / max(result.seconds, 1e-9)
    print(f"\n{len(result.finished)} rooms in {result.seconds:.1f}s ({rate:.1f} rooms/s); "
          f"{stats.get('bytes', 0) / 1e6:.1f} MB moved in {stats.get('writes', 0)} NIXL WRITEs", file=out)
    render(check, len(applied), out)
    print(f"\nlogs and JSON: {run_dir}  (diff again with: dsv4-idxk-probe diff {run_dir})", file=out)
    return 0 if check.ok else 1
