"""bench/hook_ops.py keeps counting the serving thread's work per probe call, and that
work stays out of Python's queue and threading modules (ten and three Python functions
per call before the hand-off and the collector flag replaced them)."""

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "hook_ops.py"


@pytest.fixture
def hook_ops(monkeypatch):
    spec = importlib.util.spec_from_file_location("hook_ops_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "hook_ops_bench", module)
    spec.loader.exec_module(module)
    return module


def test_the_bench_counts_every_call_kind(hook_ops, tmp_path):
    assert hook_ops.main(["--calls", "5", "--layers", "2", "--pages", "3", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "hook_ops.json").read_text())
    assert len(report) == 3
    for counts in report.values():
        assert counts["python_calls"] > 5 and counts["c_calls"] > 5 and counts["opcodes"] > 100


def test_a_receipt_runs_no_python_code_of_queue_or_threading(hook_ops):
    from dsv4_idxk_probe.pd import DecodeMonitor, RoomId

    engine = hook_ops.cuda_path_engine(2, 3)
    monitor = DecodeMonitor(engine, lambda record: None)
    monitor.room_received(RoomId(0), [1, 2, 3], 700, None)  # the collector thread is started
    time.sleep(0.05)
    modules = set()

    def profile(frame, event, arg):
        if event == "call":
            modules.add(Path(frame.f_code.co_filename).stem)

    sys.setprofile(profile)
    try:
        monitor.room_received(RoomId(1), [1, 2, 3], 700, None)
    finally:
        sys.setprofile(None)
    engine.close()
    assert {"decode", "engine", "background"} <= modules  # it did profile the receipt
    assert not modules & {"queue", "threading"}
