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


def cuda_path_engine(events, wait="block", stream="caller-stream", **options):
    """An engine on host buffers that takes its CUDA submit path: launch, device and
    stream lookup faked (as bench/hook_ops.py fakes them), events taken from `events`
    and recorded through their own `record` (to log it). `options`: the engine's own."""
    from bench.hook_ops import fake_device_calls

    buffers = [torch.zeros(4, LAYOUT.row_bytes, dtype=torch.uint8)]
    engine = fake_device_calls(DigestEngine(LAYOUT, [0], buffers, backend="triton", wait=wait, **options), events=0)
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


@pytest.mark.parametrize("batched", [False, True])
def test_with_record_collector_a_submit_only_launches_and_the_collector_records_on_its_stream(batched):
    """`record="collector"` (HiCache restore engines): the submitting thread records no event;
    the collector, when it takes the batch, records one on the stream the submit launched on,
    then waits for it. Until then the ticket is not ready: there is no event to ask."""
    event, delivered, held, release = FakeEvent(), threading.Event(), threading.Event(), threading.Event()
    engine = cuda_path_engine(iter([event]), download="collector", record="collector")
    engine.post(lambda _: held.set() or release.wait(10))  # the collector busy: the batch not taken yet
    assert held.wait(10)
    if batched:
        pending = engine.submit([RoomRequest("a", [1], 256), RoomRequest("b", [2], 256)], lambda _: delivered.set())
    else:
        pending = engine.submit_room("a", [1], 256, lambda _: delivered.set())
    assert event.log == []  # the caller recorded nothing
    assert pending.record_on == "caller-stream" and pending.done is None
    assert not pending.ready()
    release.set()
    assert delivered.wait(10)
    engine.close()
    assert event.log[:2] == [("record", "caller-stream", "dsv4-idxk-digest"), ("synchronize", None, "dsv4-idxk-digest")]
    assert pending.record_on is None


def test_with_record_collector_the_collector_defers_before_its_first_device_call(monkeypatch):
    """A HiCache restore engine's collector (record "collector", a deferral) makes no device
    call during a burst of copies: woken by the first submit, it sleeps out the deferral
    before it records the batch's event, so the burst pays no GIL hand-off to it. With the
    deferral after the record (the form before 2026-12-05) the event is recorded first."""
    from dsv4_idxk_probe.digest import collector
    from dsv4_idxk_probe.hicache.restore import engine_options

    asleep, wake = threading.Event(), threading.Event()
    real_sleep = collector.time.sleep

    def sleep(seconds):  # the deferral's sleep lasts until the test ends it
        if seconds != 0.0042:
            return real_sleep(seconds)
        asleep.set()
        wake.wait(30)

    monkeypatch.setattr(collector.time, "sleep", sleep)
    events = [FakeEvent() for _ in range(4)]
    delivered = threading.Semaphore(0)
    # built as a HiCache restore engine is (`restore._engine`)
    engine = cuda_path_engine(iter(events), **engine_options(), defer_s=0.0042, defer_rounds=1)
    first = engine.submit_room("a", [1], 256, lambda _: delivered.release())
    for key in "bc":  # the rest of the burst
        engine.submit_room(key, [1], 256, lambda _: delivered.release())
    assert asleep.wait(30)  # the collector took the first batch and sleeps
    assert events[0].log == []  # having made no device call for it
    assert first.done is None and first.record_on == "caller-stream"
    wake.set()
    assert all(delivered.acquire(timeout=30) for _ in range(3))
    engine.close()
    assert events[0].log[0] == ("record", "caller-stream", "dsv4-idxk-digest")


def test_with_hicache_restore_record_copy_the_copying_thread_records_the_event_behind_the_launch():
    """`hicache.restore_record: copy` (a fork that copies on the forward's stream): the restore
    engine's event is recorded on the copying thread, right behind the launch, before anything
    else it queues; the collector only waits for it, after its deferral."""
    from dsv4_idxk_probe.hicache.restore import engine_options

    event, delivered = FakeEvent(), threading.Event()
    engine = cuda_path_engine(iter([event]), **engine_options("copy"), defer_s=0.0, defer_rounds=1)
    copying = threading.current_thread().name
    pending = engine.submit_room("a", [1], 256, lambda _: delivered.set(), contents_only=True)
    assert event.log == [("record", "caller-stream", copying)]  # before the submit returned
    assert pending.done is event and pending.record_on is None
    assert delivered.wait(10)
    engine.close()
    assert [name for name, _, thread in event.log if thread == "dsv4-idxk-digest"] == ["synchronize"]


def test_restore_record_is_checked():
    from dsv4_idxk_probe.hicache.restore import engine_options
    from dsv4_idxk_probe.hicache.settings import RESTORE_RECORDS

    assert engine_options()["record"] == "collector" and engine_options("copy")["record"] == "submit"
    assert all(engine_options(place) for place in RESTORE_RECORDS)  # every value the config takes
    with pytest.raises(ValueError, match="record must be one of"):
        engine_options("submit")  # the engine's word, not the setting's


@pytest.mark.parametrize("defer_at, order", [("first_call", ["sleep", "synchronize"]),
                                             ("done", ["synchronize", "sleep"])])
def test_the_deferral_comes_before_the_collectors_first_device_call_or_once_the_batch_is_done(
        monkeypatch, defer_at, order):
    """`defer_at` (digest.collector_defer_at): with "first_call" the collector sleeps before it
    waits on a PD batch's event (recorded at the submit), so the serving thread's burst sees
    no GIL hand-off to it; with "done" (the form before) it waits, then sleeps."""
    from dsv4_idxk_probe.digest import collector

    event, delivered = FakeEvent(), threading.Event()
    real_sleep = collector.time.sleep

    def sleep(seconds):
        if seconds == 0.0042:
            event.log.append(("sleep", None, threading.current_thread().name))
        else:
            real_sleep(seconds)

    monkeypatch.setattr(collector.time, "sleep", sleep)
    engine = cuda_path_engine(iter([event]), defer_s=0.0042, defer_at=defer_at)
    engine.submit_room("a", [1], 256, lambda _: delivered.set())
    assert delivered.wait(10)
    engine.close()
    by_collector = [call for call, _, thread in event.log if thread == "dsv4-idxk-digest"]
    assert by_collector == order


def test_with_record_collector_digest_now_records_the_event_itself():
    event = FakeEvent()
    engine = cuda_path_engine(iter([event]), download="collector", record="collector")
    (digest,) = engine.digest_now([RoomRequest("a", [1], 256)])
    engine.close()
    assert digest.key == "a"
    assert event.log[:2] == [("record", "caller-stream", threading.current_thread().name),
                             ("synchronize", None, threading.current_thread().name)]


@pytest.mark.parametrize("options, message", [
    ({"record": "later"}, "record must be one of"),
    ({"record": "collector"}, "record 'collector' needs download 'collector'"),
    ({"record": "collector", "download": "collector", "time_kernels": True}, "time_kernels off"),
])
def test_a_record_the_engine_cannot_keep_is_refused(random_buffers, options, message):
    with pytest.raises(ValueError, match=message):
        DigestEngine(LAYOUT, [0], random_buffers(LAYOUT, 1, 2, seed=3), backend="reference", **options)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA stream and event (the H200's gputests)")
def test_on_a_gpu_a_collector_recorded_event_gives_the_digests_a_submit_recorded_one_does(random_buffers):
    buffers = [b.cuda() for b in random_buffers(LAYOUT, 2, 6, seed=8)]
    results = {}
    for record in ("submit", "collector"):
        engine = DigestEngine(LAYOUT, [0, 1], buffers, download="collector", record=record)
        got, delivered = [], threading.Event()
        pages = torch.tensor([5, 1, 3], dtype=torch.int64, device="cuda")
        engine.submit_room("r", pages, 3 * 256, lambda batch: got.append(batch) or delivered.set())
        assert delivered.wait(30)
        engine.close()
        (digest,) = got[0].digests
        results[record] = (digest.room, got[0].contents[0].copy())
    assert results["submit"][0] == results["collector"][0]
    assert (results["submit"][1] == results["collector"][1]).all() and results["submit"][1].any()


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
