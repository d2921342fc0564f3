"""The ways the rig's decode loop passes a model step's time (testbed/builtin/modeltime.py)."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from dsv4_idxk_probe.testbed.builtin import modeltime
from dsv4_idxk_probe.testbed.builtin.loopclock import LoopClock
from dsv4_idxk_probe.testbed.builtin.config import PlanError, RigConfig


def _progress_while(wait) -> int:
    """How often another thread wakes and runs while `wait` runs, with the
    interpreter's forced GIL hand-over pushed out of reach: only a wait that
    releases the GIL lets it run."""
    count, stop = [0], threading.Event()

    def ticker():
        while not stop.is_set():
            time.sleep(0.001)  # releases the GIL; needs it back to count
            count[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    thread = threading.Thread(target=ticker)
    try:
        thread.start()
        time.sleep(0.01)
        before = count[0]
        wait()
        return count[0] - before
    finally:
        stop.set()
        sys.setswitchinterval(old)
        thread.join()


def _hold_gil(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def test_spin_takes_its_time_and_lets_other_threads_run():
    started = time.perf_counter()
    assert _progress_while(lambda: modeltime.spin(0.05)) > 0
    assert time.perf_counter() - started >= 0.05
    # the check itself can fail: a wait that keeps the GIL lets nobody count
    assert _progress_while(lambda: _hold_gil(0.05)) == 0


def test_step_wait_by_name():
    assert modeltime.step_wait("sleep") is time.sleep
    assert modeltime.step_wait("spin") is modeltime.spin
    for cpu in ("cpu", torch.device("cpu"), None):
        with pytest.raises(ValueError, match="needs the rig on CUDA"):
            modeltime.step_wait("gpu", cpu)
    with pytest.raises(ValueError, match="must be one of sleep, spin, gpu"):
        modeltime.step_wait("nap")


@pytest.mark.parametrize("kwargs, message", [
    ({"decode_step_wait": "nap"}, "decode_step_wait must be one of"),
    ({"decode_step_wait": "gpu", "device": "cpu"}, "needs device 'cuda'"),
])
def test_bad_step_wait_is_named(kwargs, message):
    with pytest.raises(PlanError, match=message):
        RigConfig(**kwargs).validated()


def test_loop_clock_passes_model_time_through_the_wait_it_is_given():
    waited = []
    clock = LoopClock()
    clock.sleep(0.002, waited.append)
    clock.sleep(0.001)
    assert waited == [0.002] and clock.stats()["sleeps"] == 2


def test_busy_batches_leave_out_the_ramp(monkeypatch):
    clock, now = LoopClock(), [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    for wall, rooms in [(0, 1), (0.001, 2), (0.010, 10), (0.012, 9), (0.011, 10), (0.002, 3)]:
        now[0] += wall
        clock.batch_done(rooms)
    assert clock.busy_batches() == pytest.approx([0.010, 0.012, 0.011])  # 8 rooms or more of the 10 at most
    assert clock.stats()["busy_batch_median_us"] == pytest.approx(11000)
    assert clock.stats()["busy_tokens_per_s"] == pytest.approx((10 + 9 + 10) / (0.010 + 0.012 + 0.011))
    assert LoopClock().busy_tokens_per_s() == 0.0  # no batch yet


def test_time_parts_times_the_submit_and_the_collector():
    """What `bench/overhead.py --profile-runs` prints: the submit's parts on the serving
    thread and the collector's, per batch, in thread CPU."""
    from dsv4_idxk_probe.digest import DigestEngine, get_layout
    from dsv4_idxk_probe.pd import DecodeMonitor, RoomId

    layout = get_layout("fp8")
    buffer = torch.randint(0, 256, (4, layout.row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    engine = DigestEngine(layout, [0], [buffer], backend="reference")
    monitor = DecodeMonitor(engine, lambda record: True)
    clock = LoopClock()
    clock.time_parts(engine, monitor)
    for i in range(3):
        monitor.room_received(RoomId(i), [1, 2], 300, None)
    engine.close()  # delivers every batch
    parts = clock.stats()["parts"]
    assert parts["submit (all)"]["calls"] == 3
    for label in ("collector: wait for the event (CPU)", "collector: fold the cells (CPU)",
                  "collector: verdicts, records, metrics (CPU, _on_results)"):
        assert parts[label]["calls"] == 3, label


def test_time_parts_leaves_a_one_room_submit_its_own_path():
    """The part timers measure the serving thread's real path: a timed `submit` must not
    divert `submit_room` into the batch path (`_launch`), and the one-room launch, the
    event record and direct launchers learnt later are timed too."""
    from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, get_layout

    layout = get_layout("fp8")
    buffer = torch.randint(0, 256, (4, layout.row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    engine = DigestEngine(layout, [0], [buffer], backend="triton")
    clock = LoopClock()
    clock.time_parts(engine, None)
    for i in range(2):
        engine.submit_room(f"room-{i}", [1, 2], 300, lambda result: None)
    engine.submit([RoomRequest("r", [1], 256), RoomRequest("s", [1], 256)], lambda result: None)
    engine.close()
    parts = clock.stats()["parts"]
    assert parts["submit (all)"]["calls"] == 3
    assert parts["digest or device calls (one room)"]["calls"] == 2
    assert parts["digest or device calls (batch)"]["calls"] == 1  # submit_room not diverted to the batch path

    class Direct:  # a learnt launcher arriving after the timers were set
        def fn(self, *args):
            return len(args)

    learnt = Direct()
    engine._direct[1] = learnt
    assert learnt.fn(1, 2) == 2
    assert clock.stats()["parts"]["kernel launch (direct)"]["calls"] == 1
