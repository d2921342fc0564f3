"""pd.decode's digest observer: told of every decode digest at submit, fail-open.

A test bed (the SGLang rig's oracle) learns there when the probe digests a room
on decode, instead of wrapping the monitor's private methods.
"""

from __future__ import annotations

import pytest
import torch
from tests.support.recordsink import Sink

from dsv4_idxk_probe import safety
from dsv4_idxk_probe.digest import DigestEngine, get_layout
from dsv4_idxk_probe.pd import DecodeMonitor, RoomId
from dsv4_idxk_probe.pd.decode import add_digest_observer, remove_digest_observer

LAYER_IDS = [0, 2, 4]
LAYOUT = get_layout("fp8")


@pytest.fixture
def decode():
    g = torch.Generator().manual_seed(3)
    bufs = [torch.randint(0, 256, (8, LAYOUT.row_bytes), dtype=torch.uint8, generator=g) for _ in LAYER_IDS]
    sink = Sink()
    monitor = DecodeMonitor(DigestEngine(LAYOUT, LAYER_IDS, bufs), sink, fetch_vectors=lambda key: None)
    added = []

    def observe(observer):
        add_digest_observer(observer)
        added.append(observer)

    yield monitor, sink, observe
    for observer in added:
        remove_digest_observer(observer)
    monitor.engine.close()


def test_observer_is_told_each_submits_rooms_stages_and_steps(decode):
    monitor, sink, observe = decode
    seen = []
    observe(seen.append)
    a, b = RoomId(4), RoomId(6, attempt=1)
    monitor.room_received(a, [0, 1], 300, None)
    monitor.room_received(b, [2], 200, None)
    monitor.batch_done([b], [(a, 10)])
    assert seen == [
        [(a, "decode_recv", None)],
        [(b, "decode_recv", None)],
        [(b, "decode_finish", None), (a, "decode_step", 10)],
    ]
    assert len(sink.wait_for(4)) == 4  # the digests themselves still ran and were judged


def test_a_raising_observer_is_counted_and_breaks_nothing(decode):
    monitor, sink, observe = decode
    seen = []

    def broken(points):
        raise RuntimeError("observer bug")

    observe(broken)
    observe(seen.append)  # an observer after the broken one is still told
    before = safety.error_counts().get("decode.digest_observer", 0)
    room = RoomId(9)
    monitor.room_received(room, [3], 256, None)  # does not raise
    monitor.room_finished(room)
    assert [r["stage"] for r in sink.wait_for(2)] == ["decode_recv", "decode_finish"]
    assert seen == [[(room, "decode_recv", None)], [(room, "decode_finish", None)]]
    assert safety.error_counts()["decode.digest_observer"] == before + 2
    assert monitor.tracked() == 0


def test_a_removed_observer_is_told_nothing(decode):
    monitor, sink, observe = decode
    seen = []
    add_digest_observer(seen.append)
    remove_digest_observer(seen.append)
    remove_digest_observer(seen.append)  # twice: no error
    monitor.room_received(RoomId(1), [0], 256, None)
    sink.wait_for(1)
    assert seen == []
