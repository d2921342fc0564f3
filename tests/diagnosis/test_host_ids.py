"""Page ids on their way to the host (diagnosis/host_ids.py): read only after the
copy's event, once; host containers pass through untouched."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from dsv4_idxk_probe.diagnosis import host_ids
from dsv4_idxk_probe.diagnosis.host_ids import HostIds, capture, host_ints
from dsv4_idxk_probe.diagnosis.journal import PageGroups, PageJournal


class CountingEvent:
    def __init__(self):
        self.waits = 0

    def synchronize(self):
        self.waits += 1


def test_captured_ids_wait_for_their_copy_once_and_read_as_int64():
    event = CountingEvent()
    ids = HostIds(torch.tensor([7, 3, 9], dtype=torch.int32), event)
    assert event.waits == 0  # nothing waits at capture
    first, second = host_ints(ids), host_ints(ids)
    assert event.waits == 1
    assert first.dtype == np.int64 and first.tolist() == second.tolist() == [7, 3, 9]
    assert ids.nbytes == 12


def test_host_containers_are_kept_as_given():
    pages = torch.tensor([4, 5])
    assert capture(pages) is pages and capture([1, 2]) == [1, 2] and capture(None) is None
    assert host_ints(pages).tolist() == [4, 5] and host_ints(None).size == 0


def test_the_journal_reads_captured_pages_and_page_groups():
    journal = PageJournal(capacity=8)
    event = CountingEvent()
    journal.record("allocated", HostIds(torch.tensor([11, 12]), event), "r/0")
    tokens = torch.arange(4 * 256, 6 * 256)  # two whole pages of 256 tokens: pages 4 and 5
    journal.record("hicache_load", PageGroups(tokens, 256), host_rows=PageGroups(torch.arange(0, 512), 256))
    assert [e["event"] for e in journal.events_for(12)] == ["allocated"] and event.waits == 1
    load = journal.events_for(5)
    assert [(e["event"], e["host_row"]) for e in load] == [("hicache_load", 1)]


class RecordedEvent(CountingEvent):
    made = []

    def __init__(self):
        super().__init__()
        self.recorded = 0
        RecordedEvent.made.append(self)

    def record(self, *_):
        self.recorded += 1


def test_a_deferred_capture_is_read_only_after_its_event_is_settled(monkeypatch):
    ids = HostIds(torch.tensor([5, 6]), host_ids._UNSETTLED)
    with pytest.raises(RuntimeError, match="settled"):
        ids.numpy()  # would read a copy that may not have landed
    batch_event, later = CountingEvent(), CountingEvent()
    ids.settle(batch_event)
    ids.settle(later)  # the first settle names the event; a second changes nothing
    assert host_ints(ids).tolist() == [5, 6] and batch_event.waits == 1 and later.waits == 0
    monkeypatch.setattr(torch.cuda, "Event", RecordedEvent)
    own = HostIds(torch.tensor([1]), host_ids._UNSETTLED)
    own.settle(None)  # no batch event to ride on: one of its own, recorded now
    assert RecordedEvent.made[-1].recorded == 1 and host_ints(own).tolist() == [1]


def test_decode_allocation_copies_the_page_ids_on_the_collector_behind_the_snapshot(monkeypatch):
    """With a snapshot digest, the allocation hook copies nothing on the serving thread:
    the collector copies the page ids to the host once the snapshot is back (its event
    has completed, so the ids are on the device by then) and journals the allocation at
    the time the hook read. Without a snapshot (no launch orders the copy) the hook
    copies them itself, with an event of its own, as before."""
    import threading

    from dsv4_idxk_probe.diagnosis import ContentIndex, tracker
    from dsv4_idxk_probe.diagnosis.tracker import DecodeDiagnosis
    from dsv4_idxk_probe.digest import DigestEngine, get_layout
    from dsv4_idxk_probe.pd import DecodeMonitor, RoomId

    layout = get_layout("fp8")
    made = []

    def capture_where(pages, *, deferred=False):  # what `capture` does with a CUDA tensor, and where
        made.append(threading.current_thread().name)
        return HostIds(torch.as_tensor(pages), CountingEvent())

    monkeypatch.setattr(tracker, "capture", capture_where)
    engine = DigestEngine(layout, [0], [torch.zeros((8, layout.row_bytes), dtype=torch.uint8)])
    journal = PageJournal(capacity=16)
    diagnosis = DecodeDiagnosis(layout, [0], journal, ContentIndex(1000))
    decode = DecodeMonitor(engine, lambda *_: None, diagnosis=diagnosis, snapshot_on_allocation=True)
    caller = threading.current_thread().name
    before = time.monotonic_ns()
    try:
        decode.room_allocated(RoomId(1), torch.tensor([2, 3]), 512)
        assert caller not in made  # the serving thread copied nothing
        decode.room_allocated(RoomId(2), torch.tensor([4, 5]), 512, snapshot=False)
        assert made.count(caller) == 1  # no launch to ride on: copied at the hook
    finally:
        engine.close()
    assert sorted(made) == sorted([caller, "dsv4-idxk-digest"])
    events = journal.events_for(2) + journal.events_for(4)
    assert [(e["event"], e["room"]) for e in events] == [("allocated", "1/0"), ("allocated", "2/0")]
    assert before < events[0]["t_ns"] < events[1]["t_ns"]  # the hooks' times, in order
    # the journal keeps time order whoever records first: room 1's event came back after room 2's
    assert [e.room for e in journal._snapshot()] == ["1/0", "2/0"]
