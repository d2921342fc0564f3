"""The batch's CUDA event is recorded by the collector, behind the kernel, on the
caller's stream: the caller's thread makes one device call per submit (the launch).

No GPU here: the event and the stream are fakes that log what is asked of them.
"""

import threading

import numpy as np
import pytest

from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, get_layout
from dsv4_idxk_probe.digest.engine import PendingDigest
from dsv4_idxk_probe.digest.room_table import plan_cells

LAYOUT = get_layout("fp8")


class FakeStream:
    """A fake CUDA stream: counts synchronisations."""

    def __init__(self):
        self.synchronized = 0

    def synchronize(self):
        self.synchronized += 1


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


def _pending(event, stream):
    rooms = [RoomRequest("a", [1], 256)]
    plan = plan_cells(rooms, 1)
    return PendingDigest(plan, rooms, lambda _: None, np.zeros((plan.n_cells, 2), np.uint64), event, stream=stream)


def test_not_ready_until_recorded_on_the_callers_stream():
    event, stream = FakeEvent(), FakeStream()
    pending = _pending(event, stream)
    assert not pending.ready() and event.log == []  # an unrecorded event is never asked
    pending.record_done()
    assert event.log[0][:2] == ("record", stream) and pending.stream is None
    assert pending.ready()
    pending.record_done()  # once only
    assert [c[0] for c in event.log].count("record") == 1


def test_enforce_wait_syncs_the_stream_before_the_record_and_the_event_after():
    event, stream = FakeEvent(), FakeStream()
    pending = _pending(event, stream)
    pending.wait()
    assert stream.synchronized == 1 and event.log == []
    pending.record_done()
    pending.wait()
    assert stream.synchronized == 1 and event.log[-1][0] == "synchronize"


@pytest.mark.parametrize("wait, asks", [("block", "synchronize"), ("poll", "query")])
def test_the_collector_records_the_event_before_it_waits_for_it(random_buffers, wait, asks):
    engine = DigestEngine(LAYOUT, [0], random_buffers(LAYOUT, 1, 2, seed=3), backend="reference", wait=wait)
    event, stream, delivered = FakeEvent(), FakeStream(), threading.Event()
    real_launch = engine._launch

    def launch_with_event(rooms, callback):
        ticket = real_launch(rooms, callback)
        ticket.done, ticket.stream = event, stream  # what a CUDA launch hands the collector
        return ticket

    engine._launch = launch_with_event
    engine.submit([RoomRequest("a", [1], 256)], lambda batch: delivered.set())
    assert delivered.wait(10)
    engine.close()
    calls = [(name, thread) for name, _, thread in event.log]
    assert calls[0] == ("record", "dsv4-idxk-digest") and event.log[0][1] is stream
    assert (asks, "dsv4-idxk-digest") in calls[1:]
    assert {"query", "synchronize"} - {asks} - {name for name, _ in calls}  # one way of waiting, not both
    assert all(thread == "dsv4-idxk-digest" for _, thread in calls)  # nothing on the caller's thread


def test_an_unknown_wait_is_refused(random_buffers):
    with pytest.raises(ValueError, match="wait must be one of"):
        DigestEngine(LAYOUT, [0], random_buffers(LAYOUT, 1, 2, seed=3), backend="reference", wait="spin")


@pytest.mark.parametrize("blocking", [True, False])
def test_event_pool_makes_blocking_sync_events_when_asked(monkeypatch, blocking):
    """A blocking-sync event makes the collector sleep in the driver, not spin on a core."""
    import torch

    from dsv4_idxk_probe.digest.pinned import EventPool

    made = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kwargs: made.append(kwargs) or FakeEvent())
    pool = EventPool(blocking=blocking)
    event = pool.take()
    pool.give(event)
    assert pool.take() is event  # reused, not made again
    pool.take(timing=True)
    assert made == [{"enable_timing": False, "blocking": blocking}, {"enable_timing": True, "blocking": blocking}]


def test_record_now_records_on_the_callers_thread_before_the_collector_sees_it(random_buffers):
    """Prefill asks `ready()` right after NIXL's sync to fill the in-band slot: its
    event must already be recorded then, not whenever the collector gets to it."""
    engine = DigestEngine(LAYOUT, [0], random_buffers(LAYOUT, 1, 2, seed=4), backend="reference")
    event, stream, gate = FakeEvent(), FakeStream(), threading.Event()
    real_launch = engine._launch

    def launch_with_event(rooms, callback):
        ticket = real_launch(rooms, callback)
        ticket.done, ticket.stream = event, stream
        return ticket

    engine._launch = launch_with_event
    pending = engine.submit([RoomRequest("a", [1], 256)], lambda batch: gate.wait(10), record_now=True)
    assert event.log[0] == ("record", stream, threading.current_thread().name)
    assert pending.ready()
    gate.set()
    engine.close()
    assert [c[0] for c in event.log].count("record") == 1  # the collector did not record again


def test_prefill_sends_record_now_and_decode_stages_do_not(random_buffers):
    from dsv4_idxk_probe.pd import DecodeMonitor, PrefillMonitor, RoomId

    engine = DigestEngine(LAYOUT, [0], random_buffers(LAYOUT, 1, 4, seed=5), backend="reference")
    asked = []
    real_submit = engine.submit
    engine.submit = lambda rooms, callback, **kw: asked.append(kw.get("record_now", False)) or real_submit(rooms, callback, **kw)
    PrefillMonitor(engine, lambda record: True).room_sent(RoomId(1), [1, 2], 300)
    decode = DecodeMonitor(engine, lambda record: True)
    decode.room_received(RoomId(2), [1, 2], 300, None)
    decode.batch_done([RoomId(2)], [])
    decode.room_received(RoomId(3), [1, 2], 300, None, record_now=True)  # enforce mode will wait on it
    engine.close()
    assert asked == [True, False, False, True]


class BrokenEvent(FakeEvent):
    """A fake event whose record fails, as a device call can."""

    def record(self, stream=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_failed_record_drops_that_batch_and_the_collector_goes_on(random_buffers):
    engine = DigestEngine(LAYOUT, [0], random_buffers(LAYOUT, 1, 2, seed=6), backend="reference")
    events = iter([BrokenEvent(), FakeEvent()])
    real_launch = engine._launch
    kept = []

    def launch_with_event(rooms, callback):
        ticket = real_launch(rooms, callback)
        ticket.done, ticket.stream = next(events), FakeStream()
        kept.append(ticket)
        return ticket

    engine._launch = launch_with_event
    delivered, second = [], threading.Event()
    engine.submit([RoomRequest("lost", [1], 256)], delivered.append)
    engine.submit([RoomRequest("next", [1], 256)], lambda batch: delivered.append(batch) or second.set())
    assert second.wait(10)
    engine.close()
    lost, kept_going = delivered
    assert lost.digests == [] and lost.error.startswith("RuntimeError: CUDA error")
    assert [d.key for d in kept_going.digests] == ["next"] and kept_going.error is None
    assert engine.stats.dropped_batches == 1
    assert kept[0].done is not None  # never released to the pools: the GPU may still write its buffer


def test_polls_back_off_to_a_few_per_forward():
    from itertools import islice

    from dsv4_idxk_probe.digest.engine import poll_intervals

    waits = list(islice(poll_intervals(0.0005, 0.004), 7))
    assert waits == [0.0005, 0.001, 0.002, 0.004, 0.004, 0.004, 0.004]
    slept, polls = 0.0, 0
    for wait in poll_intervals(0.0005, 0.004):  # an event behind a 30 ms forward
        polls += 1
        slept += wait
        if slept >= 0.030:
            break
    assert polls <= 10  # a fixed 0.5 ms poll would take 60


def test_a_failed_batch_is_reported_skipped_and_its_rooms_forgotten(random_buffers):
    from dsv4_idxk_probe.pd import DecodeMonitor, RoomId

    engine = DigestEngine(LAYOUT, [0], random_buffers(LAYOUT, 1, 4, seed=8), backend="reference")
    records = []
    monitor = DecodeMonitor(engine, records.append)
    monitor.room_received(RoomId(1), [1, 2], 300, None)
    real_launch = engine._launch

    def failing_launch(rooms, callback):
        ticket = real_launch(rooms, callback)
        ticket.done, ticket.stream = BrokenEvent(), FakeStream()
        return ticket

    engine._launch = failing_launch
    monitor.batch_done([RoomId(1)], [])  # the finish digest's event cannot be recorded
    engine.close()
    finish = [r for r in records if r["stage"] == "decode_finish"]
    assert len(finish) == 1 and finish[0]["verdict"] == "skipped"
    assert finish[0]["reason"].startswith("digest failed: RuntimeError: CUDA error")
    assert monitor.tracked() == 0  # finished, nothing in flight: forgotten
