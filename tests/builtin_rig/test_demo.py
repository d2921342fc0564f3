"""The demo as a user runs it, and the rig on every shipped layout."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from tests.support.rigutil import diff_rooms, dump, run

from dsv4_idxk_probe.testbed.builtin.config import RigConfig, explicit_plan

HAS_SGLANG = importlib.util.find_spec("sglang") is not None


def test_demo_finds_every_shipped_fault_and_nothing_else(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_IDXK_PROBE")}
    cmd = [sys.executable, "-m", "dsv4_idxk_probe", "demo", "--rig", "builtin", "--rooms", "24", "--layers", "4", "--plain"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert "RESULT: every injected fault found, localised, at its first stage; nothing else reported" in out
    assert "metrics: http://127.0.0.1:" in out and "rooms verified 24/24" in out
    source = "SGLang DeepSeekV4IndexerPool" if HAS_SGLANG else "the built-in allocator"
    assert out.count(f"buffers from {source}") == 2
    (run_dir,) = (tmp_path / "probe-logs").iterdir()  # logs under ./probe-logs, one folder per run
    verification = json.loads((run_dir / "verification.json").read_text())
    applied = [f for f in verification["faults"] if f["applied"]]
    assert verification["ok"] and len(applied) >= 12 and all(f["ok"] for f in applied)
    assert verification["unexplained"] == [] and verification["oracle_disagreements"] == []
    diff = json.loads((run_dir / "diff.json").read_text())
    assert diff["exit_status"] == 1 and diff["summary"]["room_verdicts"]["mismatch"] >= 10
    assert {p.name.split("-")[0] for p in run_dir.glob("*.jsonl")} == {"prefill", "decode"}


LAYOUT_CASES = {
    # layout: (fault, expected layer_segments, expected pages) per room
    "fp4": [
        ({"kind": "bitflip", "when": "in_flight", "where": {"layer": 1, "page": 0, "segment": "scale", "offset": 20}}, [[1, "scale"]], [0]),
        ({"kind": "partial_write", "when": "in_flight", "keep_bytes": 4100, "where": {"layer": 0, "page": 1}}, [[0, "scale"]], [1]),
        ({"kind": "byte_set", "when": {"after_step": 2}, "value": 0, "where": {"layer": 0, "page": 0, "segment": "payload", "range": [640, 700]}}, [[0, "payload"]], [0]),
    ],
    "bf16": [
        ({"kind": "bitflip", "when": "before_send", "where": {"layer": 1, "page": "last", "segment": "payload", "offset": 2560}}, [[1, "payload"]], [1]),
        ({"kind": "partial_write", "when": "in_flight", "keep_bytes": 8000, "where": {"layer": 0, "page": 0}}, [[0, "payload"]], [0]),
        ({"kind": "zero_page", "when": "after_recv", "where": {"layer": 1, "page": 1}}, [[1, "payload"]], [1]),
    ],
}


@pytest.mark.parametrize("layout", sorted(LAYOUT_CASES))
def test_other_layouts_localise_their_own_segments(tmp_path, layout):
    cases = LAYOUT_CASES[layout]
    rows = [(i + 1, 400, 0, 6) for i in range(len(cases))] + [(9, 300, 0, 6)]  # page 1 holds 36 frozen slots
    faults = [{"room": i + 1, **fault} for i, (fault, _, _) in enumerate(cases)]
    cfg = RigConfig(layers=2, layout=layout, plan=explicit_plan(rows), pool_source="auto")
    result = run(tmp_path, cfg, faults=faults, step_interval=4)
    want_source = "sglang" if HAS_SGLANG and layout == "fp4" else "builtin"
    assert result.info["decode"]["pool_source"] == result.info["prefill"]["pool_source"] == want_source
    _, doc, rooms = diff_rooms(tmp_path / "logs")
    for i, (fault, layer_segs, pages) in enumerate(cases):
        first = next(s for s in rooms[i + 1]["stages"] if s["verdict"] == "mismatch")
        assert first["localisation"]["layer_segments"] == layer_segs, dump(first)
        assert first["localisation"]["pages"] == pages, dump(first)
    assert rooms[9]["verdict"] == "match", dump(doc["summary"])
