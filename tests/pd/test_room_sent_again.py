"""A room sent again (DeepSeek-V4's rebootstrap resends the same room id, attempt 0):
prefill's table answers for it only with the digest of its latest send.

Decode asks the exchange after the new transfer landed. Before the fix, prefill answered
with the earlier transfer's digest until its collector put the new one (or for good, when
the new one was dropped), and a clean rebootstrap whose bytes differ from the first
transfer's (recomputed under new weights) read `mismatch`.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from tests.support.recordsink import Sink

from dsv4_idxk_probe.digest import DigestEngine, get_layout
from dsv4_idxk_probe.digest.result import RoomDigest
from dsv4_idxk_probe.metrics.definitions import ProbeMetrics
from dsv4_idxk_probe.pd import DecodeMonitor, PrefillMonitor, RoomId
from dsv4_idxk_probe.pd.prefill import RecentRooms

LAYER_IDS = [0, 2, 4]
LAYOUT = get_layout("fp8")
ROOM = RoomId(4242)
PREFILL_PAGES, DECODE_PAGES = [1, 3], [5, 6]
TOKENS = 2 * 256


def _buffers(seed: int, pages: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (pages, LAYOUT.row_bytes), dtype=torch.uint8, generator=g) for _ in LAYER_IDS]


def _transfer(src, dst) -> None:
    for s, d in zip(src, dst):
        d[DECODE_PAGES] = s[PREFILL_PAGES]


def _digest(key: str, value: int) -> RoomDigest:
    return RoomDigest(key, 0, 1, (0,), ("payload",), np.full((1, 1), value, dtype=np.uint64),
                      np.zeros(1, dtype=np.uint64))


def _room_digest(record: dict) -> int:
    return int(record["digest"]["room"], 16)


@pytest.fixture
def pair():
    """Prefill and decode monitors; decode has no in-band digest (Mooncake, PP prefill,
    V4.1's further pools) and asks prefill's table."""
    pre_bufs, dec_bufs = _buffers(1), _buffers(2)
    pre_sink, dec_sink = Sink(), Sink()
    prefill = PrefillMonitor(DigestEngine(LAYOUT, LAYER_IDS, pre_bufs), pre_sink)
    decode = DecodeMonitor(DigestEngine(LAYOUT, LAYER_IDS, dec_bufs), dec_sink,
                           ProbeMetrics(CollectorRegistry(), role="decode"), fetch_vectors=prefill.lookup)
    yield prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink
    prefill.engine.close()
    decode.engine.close()


def _hold_collector(engine) -> threading.Event:
    """Block `engine`'s collector (a note that waits) until the returned event is set."""
    release, held = threading.Event(), threading.Event()

    def wait(_arg):
        held.set()
        release.wait(30)

    engine.post(wait)
    assert held.wait(30)
    return release


def test_a_room_sent_again_is_not_answered_with_its_earlier_digest(pair):
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink = pair
    prefill.room_sent(ROOM, PREFILL_PAGES, TOKENS)
    first = pre_sink.wait_for(1)[0]
    assert prefill.lookup(ROOM.key).room == _room_digest(first)
    for buf in pre_bufs:  # recomputed under new weights: other bytes, the same tokens
        buf[PREFILL_PAGES] ^= 0x01
    release = _hold_collector(prefill.engine)  # prefill's collector is behind
    try:
        prefill.room_sent(ROOM, PREFILL_PAGES, TOKENS)  # the rebootstrap's send
        _transfer(pre_bufs, dec_bufs)  # lands intact
        assert prefill.lookup(ROOM.key) is None  # not the first transfer's digest
        decode.room_received(ROOM, DECODE_PAGES, TOKENS, None)
        record = dec_sink.wait_for(1)[0]
        assert record["verdict"] == "unverified"  # asked before the digest was in: never `mismatch`
    finally:
        release.set()
    second = pre_sink.wait_for(2)[1]
    assert _room_digest(second) != _room_digest(first)
    assert prefill.lookup(ROOM.key).room == _room_digest(second)
    decode.room_finished(ROOM)
    assert dec_sink.wait_for(2)[1]["verdict"] == "match"  # asked again: the second transfer's digest


def test_a_send_whose_digest_is_dropped_leaves_the_room_unanswered(pair):
    prefill, _, _, _, pre_sink, _ = pair
    prefill.room_sent(ROOM, PREFILL_PAGES, TOKENS)
    pre_sink.wait_for(1)
    prefill.engine.submit_room = lambda *a, **k: None  # a full queue
    assert prefill.room_sent(ROOM, PREFILL_PAGES, TOKENS) is None
    assert prefill.lookup(ROOM.key) is None


def test_a_send_whose_submit_raises_leaves_the_room_unanswered(pair):
    prefill, _, _, _, pre_sink, _ = pair
    prefill.rooms_sent([(ROOM, PREFILL_PAGES, TOKENS)])
    pre_sink.wait_for(1)

    def broken(*_a, **_k):
        raise RuntimeError("launch failed")

    prefill.engine.submit = broken
    with pytest.raises(RuntimeError):
        prefill.rooms_sent([(ROOM, PREFILL_PAGES, TOKENS)])
    assert prefill.lookup(ROOM.key) is None


def test_a_late_digest_of_an_earlier_send_does_not_answer_for_the_latest():
    table = RecentRooms(8)
    first, second = table.sending("7/0"), table.sending("7/0")
    table.put(_digest("7/0", 1), first)  # the collector, behind, delivers the earlier one now
    assert table.get("7/0") is None
    table.put(_digest("7/0", 2), second)
    assert table.get("7/0").room == 2
    table.unsent("7/0", second)  # names a send already in: changes nothing
    assert table.get("7/0").room == 2


def test_marks_of_sends_whose_digests_never_came_are_bounded():
    table = RecentRooms(2)
    sends = [table.sending(f"{room}/0") for room in range(5)]
    assert len(table._sending) == 2
    table.put(_digest("0/0", 1), sends[0])  # its mark went with the bound: kept, as before marks
    assert table.get("0/0").room == 1
