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
from importlib import resources
from pathlib import Path
from typing import TextIO

import yaml

from ..digest import get_layout
from .plan import RigConfig, RoleEnv
from .progress import RigProgress
from .rig import check_inputs, run_rig
from .settings import child_env
from .verify import Verification, as_json, stage_label, verify


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


def shipped_fault_spec() -> Path:
    """configs/faults/demo.yaml, as installed with the package."""
    return Path(str(resources.files("dsv4_idxk_probe").joinpath("configs", "faults", "demo.yaml")))


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


def _short(text: str, width: int = 48) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def render(check: Verification, n_applied: int, out: TextIO) -> None:
    """The end-of-run answer: each injected fault, found or not, where and when."""
    verdicts = ", ".join(f"{k} {v}" for k, v in sorted(check.verdicts.items()))
    print(f"diff (exit {check.diff_status}): rooms by worst stage: {verdicts}", file=out)
    print(f"\ninjected faults ({n_applied} applied):", file=out)
    rows = [("", "fault", "room", "expected", "probe saw", "where", "diagnosis", "")]
    for c in check.checks:
        expected = "; ".join(dict.fromkeys(stage_label(e["stage"], e["step"]) for e in c.expected)) or "(invisible)"
        mark = "ok" if c.ok else "MISSED"
        if not c.record["applied"]:
            mark, expected = "n/a", "-"
        rows.append((mark, c.label, str(c.record.get("rig_room") or c.record["room"]), expected, c.seen, c.localised,
                     _short(c.diagnosed), c.note))
    widths = [max(len(r[i]) for r in rows) for i in range(7)]
    for r in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(r[:7], widths)) + (f"  {r[7]}" if r[7] else ""), file=out)
    found = sum(1 for c in check.checks if c.record["applied"] and c.ok)
    print(f"\nfound where and when expected: {found}/{n_applied}; mismatches no fault explains: "
          f"{len(check.unexplained)}; probe vs byte-level oracle: {check.oracle_checked - len(check.oracle_disagreements)}"
          f"/{check.oracle_checked} digest points agree", file=out)
    for line in (check.unexplained + check.oracle_disagreements)[:20]:
        print(f"  ! {line}", file=out)
    if check.unfinished:
        print(f"rooms never verified at decode_finish (unverified): {len(check.unfinished)}", file=out)
    print("RESULT: " + ("every injected fault found, localised, at its first stage; nothing else reported"
                        if check.ok else "the probe MISSED or INVENTED something (see above)"), file=out)
