"""Helpers for the rig's end-to-end tests: write a probe config, run, read the diff.

Every run is bounded (`timeout_s`) and the probe reaches the children only
through their environment, as it would reach a pod.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import yaml

from dsv4_idxk_probe.testbed.builtin.config import RigConfig, RoleEnv
from dsv4_idxk_probe.testbed.builtin.rig import RigResult, run_rig
from dsv4_idxk_probe.testbed.builtin.settings import child_env
from dsv4_idxk_probe.testbed.faults.verify import run_diff

RUN_TIMEOUT_S = 150


class _NoAliases(yaml.SafeDumper):
    """Writes a shared object out again instead of as an anchor: the probe's loaders refuse anchors."""

    def ignore_aliases(self, data):
        return True


def write_probe_config(tmp_path: Path, *, step_interval: int = 4, **sections) -> Path:
    """A probe config whose room log goes under tmp_path/logs."""
    doc = {"step_interval": step_interval, "roomlog": {"dir": str(tmp_path / "logs")}, **sections}
    path = tmp_path / "probe.yaml"
    path.write_text(yaml.dump(doc, Dumper=_NoAliases))
    return path


def write_faults(tmp_path: Path, faults: list[dict]) -> Path:
    path = tmp_path / "faults.yaml"
    path.write_text(yaml.dump({"version": 1, "faults": faults}, Dumper=_NoAliases, sort_keys=False))
    return path


def run(
    tmp_path: Path,
    cfg: RigConfig,
    *,
    faults: list[dict] | None = None,
    step_interval: int = 4,
    prefill_probe: bool = True,
    decode_probe: bool = True,
    config_sections: dict | None = None,
    **kwargs,
) -> RigResult:
    config = write_probe_config(tmp_path, step_interval=step_interval, **(config_sections or {}))
    fault_file = write_faults(tmp_path, faults) if faults else None
    env = RoleEnv(
        prefill=child_env(probe=prefill_probe, config=str(config), faults=str(fault_file) if fault_file else None),
        decode=child_env(probe=decode_probe, config=str(config), faults=str(fault_file) if fault_file else None),
    )
    return run_rig(cfg, env, timeout_s=RUN_TIMEOUT_S, **kwargs)


def diff_rooms(log_dir: Path) -> tuple[int, dict, dict[int, dict]]:
    """(diff exit status, its JSON, room id -> room entry) from the product's diff."""
    status, doc = run_diff(log_dir)
    return status, doc, {int(r["room"]): r for r in doc["rooms"] if r["attempt"] == 0}


def stages_of(room: dict) -> list[tuple[str, int | None, str, dict | None]]:
    return [(s["stage"], s["step"], s["verdict"], s.get("localisation")) for s in room["stages"]]


def free_port() -> int:
    """A loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dump(obj) -> str:
    return json.dumps(obj, indent=1, default=str)[:4000]
