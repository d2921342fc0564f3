"""Decode tracks a bounded number of rooms: rooms that never finish cannot grow memory."""

from __future__ import annotations

import torch
from pd_testkit import Sink

from dsv4_idxk_probe.digest import DigestEngine, get_layout
from dsv4_idxk_probe.pd import DecodeMonitor, RoomId
from dsv4_idxk_probe.pd.decode import RECEIVED_AGAIN


def test_oldest_room_is_dropped_as_skipped_beyond_the_bound():
    layout = get_layout("fp8")
    buffers = [torch.zeros((4, layout.row_bytes), dtype=torch.uint8)]
    sink = Sink()
    monitor = DecodeMonitor(DigestEngine(layout, [1], buffers), sink, max_rooms=2)
    for room in (1, 2, 3):
        monitor.room_received(RoomId(room), [room], 256, None)
    skipped = sink.wait_for(1, verdict="skipped")
    assert [(r["room"], r["reason"]) for r in skipped] == [("1", "evicted: tracking table full")]
    assert monitor.tracked() == 2
    monitor.room_received(RoomId(2), [2], 256, None)  # the same room again replaces, never evicts:
    skipped = sink.wait_for(2, verdict="skipped")  # its earlier transfer is closed, no other room goes
    assert [(r["room"], r["reason"]) for r in skipped] == [("1", "evicted: tracking table full"),
                                                          ("2", RECEIVED_AGAIN)]
    assert monitor.tracked() == 2
    monitor.engine.close()
