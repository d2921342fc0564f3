"""The batch's CUDA event is recorded on the caller's thread, right behind the kernel,
on the stream it ran on; the collector only waits for it.

Why not let the collector record it: recorded later it would sit behind whatever the
caller enqueued meanwhile (the next forward), and the collector would wake with the
serving thread, both wanting the GIL (docs/overhead.md).

No GPU here: the engine takes its CUDA submit path with the device calls faked, and
the event and the stream are fakes that log what is asked of them, and on which thread.
"""

import threading
import numpy as np
import pytest
import torch

from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, get_layout
from dsv4_idxk_probe.digest.engine import PendingDigest
from dsv4_idxk_probe.digest.room_table import plan_cells

LAYOUT = get_layout("fp8")


class FakeEvent:
    """A fake CUDA event: complete once recorded; logs each call with its thread."""

    def __init__(self):
        self.log, self.recorded_on = [], None

    def record(self, stream=None):
        self.log.append(("record", stream, threading.current_thread().name))
        self.recorded_on = stream

    def query(self):
        self.log.append(("query", None, threading.current_thread().name))
        return self.recorded_on is not None

    def synchronize(self):
        self.log.append(("synchronize", None, threading.current_thread().name))


def cuda_path_engine(events, wait="block", stream="caller-stream"):
    """An engine on host buffers that takes its CUDA submit path: launch, device and
    stream lookup faked (as bench/hook_ops.py fakes them), events taken from `events`
    and recorded through their own `record` (to log it)."""
    from bench.hook_ops import fake_device_calls

    buffers = [torch.zeros(4, LAYOUT.row_bytes, dtype=torch.uint8)]
    engine = fake_device_calls(DigestEngine(LAYOUT, [0], buffers, backend="triton", wait=wait), events=0)
    engine._events.take = lambda timing=False: next(events)
    engine._events.max_free = 0  # none kept: every batch takes the next of `events`
    engine._streams[7] = stream  # the torch stream of raw handle 7
    engine._record = lambda event, on: event.record(on)
    return engine


def test_a_ready_batch_asks_its_event_and_enforce_waits_on_it():
    event = FakeEvent()
    rooms = [RoomRequest("a", [1], 256)]
    plan = plan_cells(rooms, 1)
    pending = PendingDigest(plan, rooms, lambda _: None, np.zeros((plan.n_cells, 2), np.uint64), event)
    assert not pending.ready()  # recorded nowhere yet: the fake is not complete
    event.record("s")
    assert pending.ready()
    pending.wait()
    assert event.log[-1][0] == "synchronize"


@pytest.mark.parametrize("wait, asks", [("block", "synchronize"), ("poll", "query")])
def test_the_caller_records_the_event_behind_the_kernel_and_the_collector_only_waits(wait, asks):
    event, delivered, gate = FakeEvent(), threading.Event(), threading.Event()
    engine = cuda_path_engine(iter([event]), wait=wait)
    caller = threading.current_thread().name
    pending = engine.submit([RoomRequest("a", [1], 256)], lambda batch: gate.wait(10) and delivered.set())
    assert event.log == [("record", "caller-stream", caller)]  # before submit returns
    assert pending.ready()  # what prefill asks right after NIXL's sync
    gate.set()
    assert delivered.wait(10)
    engine.close()
    by_collector = {name for name, _, thread in event.log if thread == "dsv4-idxk-digest"}
    assert by_collector == {asks}  # waits one way, records nothing


def test_an_unknown_wait_is_refused(random_buffers):
    with pytest.raises(ValueError, match="wait must be one of"):
        DigestEngine(LAYOUT, [0], random_buffers(LAYOUT, 1, 2, seed=3), backend="reference", wait="spin")


@pytest.mark.parametrize("blocking", [True, False])
def test_event_pool_makes_blocking_sync_events_when_asked(monkeypatch, blocking):
    """A blocking-sync event makes the collector sleep in the driver, not spin on a core."""
    from dsv4_idxk_probe.digest.pinned import EventPool

    made = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kwargs: made.append(kwargs) or FakeEvent())
    pool = EventPool(blocking=blocking)
    event = pool.take()
    pool.give(event)
    assert pool.take() is event  # reused, not made again
    pool.take(timing=True)
    assert made == [{"enable_timing": False, "blocking": blocking}, {"enable_timing": True, "blocking": blocking}]


class BrokenEvent(FakeEvent):
    """A fake event whose record fails, as a device call can."""

    def record(self, stream=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


class BrokenWait(FakeEvent):
    """A fake event whose wait fails, as a device call can."""

    def synchronize(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.mark.parametrize("broken, site", [(BrokenEvent, "digest.record"), (BrokenWait, "digest.await")])
def test_a_failed_device_call_drops_that_batch_and_serving_and_the_collector_go_on(broken, site):
    from dsv4_idxk_probe import safety

    before = safety.error_counts().get(site, 0)
    lost_event = broken()
    engine = cuda_path_engine(iter([lost_event, FakeEvent()]))
    delivered, second = [], threading.Event()
    lost = engine.submit([RoomRequest("lost", [1], 256)], delivered.append)  # does not raise here
    engine.submit([RoomRequest("next", [1], 256)], lambda batch: delivered.append(batch) or second.set())
    assert second.wait(10)
    engine.close()
    lost_batch, kept_going = delivered
    assert lost_batch.digests == [] and lost_batch.error.startswith("RuntimeError: CUDA error")
    assert [d.key for d in kept_going.digests] == ["next"] and kept_going.error is None
    assert engine.stats.dropped_batches == 1
    assert safety.error_counts()[site] == before + 1
    assert lost.done is lost_event and lost.staging is not None  # never back in the pools: the GPU may still write
    if broken is BrokenEvent:  # its cells will never be written: neither ready nor worth a wait
        assert not lost.ready() and lost.wait() is False


def test_polls_back_off_to_a_few_per_forward():
    from itertools import islice

    from dsv4_idxk_probe.digest.collector import poll_intervals

    waits = list(islice(poll_intervals(0.0005, 0.004), 7))
    assert waits == [0.0005, 0.001, 0.002, 0.004, 0.004, 0.004, 0.004]
    slept, polls = 0.0, 0
    for wait in poll_intervals(0.0005, 0.004):  # an event behind a 30 ms forward
        polls += 1
        slept += wait
        if slept >= 0.030:
            break
    assert polls <= 10  # a fixed 0.5 ms poll would take 60


def test_a_failed_batch_is_reported_skipped_and_its_rooms_forgotten():
    from dsv4_idxk_probe.pd import DecodeMonitor, RoomId

    engine = cuda_path_engine(iter([FakeEvent(), BrokenEvent()]))  # receipt, finish
    records = []
    monitor = DecodeMonitor(engine, records.append)
    monitor.room_received(RoomId(1), [1, 2], 300, None)
    monitor.batch_done([RoomId(1)], [])  # the finish digest's event cannot be recorded
    engine.close()
    finish = [r for r in records if r["stage"] == "decode_finish"]
    assert len(finish) == 1 and finish[0]["verdict"] == "skipped"
    assert finish[0]["reason"].startswith("digest failed: RuntimeError: CUDA error")
    assert monitor.tracked() == 0  # finished, nothing in flight: forgotten
