"""Page ids on their way to the host (diagnosis/host_ids.py): read only after the
copy's event, once; host containers pass through untouched."""

from __future__ import annotations

import numpy as np
import torch

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
