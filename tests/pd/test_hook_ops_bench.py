"""bench/hook_ops.py keeps counting the serving thread's work per probe call, that work
stays small (a launch and little else), and it stays out of Python's queue and threading
modules (ten and three Python functions per call before the hand-off and the collector
flag replaced them)."""

import json
import sys
import time
from pathlib import Path

import pytest
import torch


@pytest.fixture
def hook_ops():
    from bench import hook_ops

    return hook_ops


@pytest.mark.parametrize("diagnosis", [False, True])
def test_the_bench_counts_every_call_kind(hook_ops, tmp_path, diagnosis):
    argv = ["--calls", "5", "--layers", "2", "--pages", "3", "--out", str(tmp_path)]
    argv += ["--diagnosis"] if diagnosis else []
    assert hook_ops.main(argv) == 0
    report = json.loads((tmp_path / "hook_ops.json").read_text())
    assert len(report) == 5 + diagnosis  # receipt, step batch, finishing batch, finish, send (+ allocation)
    for counts in report.values():
        assert counts["python_calls"] >= 4 and counts["c_calls"] >= 8 and counts["opcodes"] > 100


def test_a_one_room_hook_call_is_a_launch_and_little_else(hook_ops, tmp_path):
    """What a one-room hook call runs on the serving thread (2026-12-03): the monitor's
    method, the room's state at receipt, the engine's submit and launch, the hand-off
    (and the bench's own lambda); the journal, the tables, the records and the metrics
    are the collector's. It was 25-33 Python functions (bench/RESULTS.md) before those
    moved off the serving thread. A send marks its room in prefill's table (one call more,
    2026-12-08): a room sent again is never answered with its earlier transfer's digest."""
    assert hook_ops.main(["--calls", "5", "--layers", "2", "--pages", "3", "--diagnosis", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "hook_ops.json").read_text())
    most = {"decode allocation (room_allocated)": 5, "decode receipt (room_received)": 6,
            "decode finish of one room (room_finished)": 5, "prefill send (slice, room_sent)": 6}
    for call, python_calls in most.items():
        assert report[call]["python_calls"] <= python_calls, (call, report[call])


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


def test_hook_cost_builds_its_engines_as_the_probe_config_does():
    """bench/hook_cost.py's engines take each role's options from `DigestEngine.role_options`,
    the ones `from_config` gives the serving sides (the deferral too, which the bench once
    left at 0)."""
    from bench import hook_cost
    from dsv4_idxk_probe.config import parse_config
    from dsv4_idxk_probe.digest import DigestEngine

    for diagnosis in (True, False):
        engines = hook_cost.fake_engines(2, 3, diagnosis)
        config = parse_config({"diagnosis": {"enabled": diagnosis}})
        for engine, role in zip(engines, ("decode", "prefill")):
            want = DigestEngine.role_options(config, role)
            got = {"wait": engine.wait, "outputs": engine.outputs, "dependent_launch": engine.dependent_launch,
                   "defer_s": engine.defer_s, "defer_at": engine.defer_at, "contents": engine.contents,
                   "download": engine.download}
            assert got == want, role
            assert engine.defer_s > 0 and engine.contents == (diagnosis and role == "decode")
            # prefill's engine reads the token indices its hook passes, as `PrefillSide` builds it
            assert engine.page_id_stride == (hook_cost.PAGE_TOKENS if role == "prefill" else 1), role
            engine.close()


def test_prefill_sends_in_the_benches_pass_each_pages_token_indices():
    """The benches' prefill table is the hook's: a row of token indices, 256 per page, whose
    pages (each page's first index over 256) are the rooms' page ids."""
    from bench import hook_cost
    from dsv4_idxk_probe.sglang.index_k import page_ids_of

    rows = hook_cost.request_table(3, 4, "cpu")
    assert rows.dtype == torch.int32 and rows.shape == (3, 4 * hook_cost.PAGE_TOKENS)
    for row, ids in zip(rows, hook_cost.page_ids(3, 4)):
        assert page_ids_of(row, hook_cost.PAGE_TOKENS).tolist() == ids.tolist()
        assert (row.diff() == 1).sum() >= 4 * (hook_cost.PAGE_TOKENS - 1)  # token runs within each page


@pytest.mark.parametrize("send_table", ["tokens", "divided"])
def test_hook_cost_times_each_send_table_on_the_faked_path(send_table, tmp_path):
    """bench/hook_cost.py's send kind runs with either table (the hook now, the hook before)
    and reports which, with every timed call counted."""
    from bench import hook_cost

    argv = ["--fake-launch", "--calls", "5", "--warm-up", "2", "--layers", "2", "--pages", "3", "--kinds", "send",
            "--gap-ms", "0", "--send-table", send_table, "--out", str(tmp_path)]
    assert hook_cost.main(argv) == 0
    report = json.loads((tmp_path / "hook_cost.json").read_text())
    send = report["kinds"]["send"]
    assert report["send_table"] == send_table and send["calls"] == 5
    # the signs of a collector falling behind: the serving thread's own staging allocations, the backlog
    assert isinstance(send["staging_allocations"], int) and send["staging_allocations"] >= 0
    assert 0 <= send["backlog"]["median"] <= send["backlog"]["max"] <= 5 + 2


def test_hook_cost_counts_the_serving_threads_own_staging_allocations_only():
    """bench/hook_cost.py's "allocated" column: a take that allocates on the timing thread
    counts, one on another thread (the collector's refill) does not, though the pool's own
    counter takes both."""
    import threading

    from bench import hook_cost

    engines = hook_cost.fake_engines(2, 3, False)
    count = hook_cost.count_serving_allocations(engines)
    pool = engines[0]._staging
    before = pool.allocations
    pool.take(1 << 20)  # a class nothing was allocated in: allocates here
    other = threading.Thread(target=pool.take, args=(1 << 21,))
    other.start()
    other.join()
    assert pool.allocations - before == 2 and count == [1]
    for engine in engines:
        engine.close()


@pytest.mark.parametrize("burst", [1, 4])
def test_hook_cost_waits_once_per_burst_and_reports_the_collectors_cpu(burst, tmp_path, monkeypatch):
    """bench/hook_cost.py's `--burst K` makes K calls per gap (a step's rooms), so it waits
    once per K calls, and each kind reports its collectors' CPU per timed call, which is
    more than nothing where each call submits a batch."""
    from bench import hook_cost

    gap_s, sleep, waits = 0.0001234, time.sleep, []

    def counting_sleep(seconds):
        if seconds == gap_s:
            waits.append(seconds)
        sleep(seconds)

    monkeypatch.setattr(time, "sleep", counting_sleep)
    argv = ["--fake-launch", "--calls", "8", "--warm-up", "4", "--layers", "2", "--pages", "3", "--kinds", "send",
            "--gap-ms", str(gap_s * 1e3), "--burst", str(burst), "--out", str(tmp_path)]
    assert hook_cost.main(argv) == 0
    report = json.loads((tmp_path / "hook_cost.json").read_text())
    assert report["burst"] == burst and len(waits) == 12 // burst
    assert report["kinds"]["send"]["collector_cpu_us_per_call"] > 0


def test_hook_cost_refuses_a_burst_below_one(capsys):
    from bench import hook_cost

    assert hook_cost.main(["--fake-launch", "--burst", "0"]) == 2
    assert "--burst must be at least 1" in capsys.readouterr().err
