"""PrefillMonitor and DecodeMonitor over host buffers (reference backend).

Prefill and decode hold the same room in different physical pages; a byte
changed in decode memory must be reported at the first stage that sees it,
localised to its (layer, page, segment), with earlier stages shown as match.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from tests.support.recordsink import Sink

from dsv4_idxk_probe.digest import DigestEngine, get_layout
from dsv4_idxk_probe.digest.reference import digest_room
from dsv4_idxk_probe.metrics.definitions import ProbeMetrics, process_labels
from dsv4_idxk_probe.pd import DecodeMonitor, InbandDigest, PrefillMonitor, RoomId
from dsv4_idxk_probe.pd import decode as decode_module

BASE = process_labels(role="decode")  # the process labels of a decode monitor outside SGLang
LAYER_IDS = [0, 2, 4]
LAYOUT = get_layout("fp8")


def _buffers(seed: int, pages: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (pages, LAYOUT.row_bytes), dtype=torch.uint8, generator=g) for _ in LAYER_IDS]


def _copy_room(src, src_pages, dst, dst_pages):
    for s, d in zip(src, dst):
        d[dst_pages] = s[src_pages]


@pytest.fixture
def pair():
    """A prefill and a decode monitor wired through an in-memory 'exchange'."""
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, role="decode")
    pre_bufs, dec_bufs = _buffers(1), _buffers(2)
    pre_sink, dec_sink = Sink(), Sink()
    prefill = PrefillMonitor(DigestEngine(LAYOUT, LAYER_IDS, pre_bufs), pre_sink)
    decode = DecodeMonitor(
        DigestEngine(LAYOUT, LAYER_IDS, dec_bufs), dec_sink, metrics, fetch_vectors=prefill.lookup, step_interval=10
    )
    yield prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry
    prefill.engine.close()
    decode.engine.close()


def _send(prefill, pre_sink, room, pages, n_tokens) -> InbandDigest:
    pending = prefill.room_sent(room, pages, n_tokens)
    pre_sink.wait_for(1)
    assert pending.ready()
    return InbandDigest(int(pending.room_digests[0]), prefill.engine.signature, n_tokens)


def test_clean_room_matches_at_every_stage(pair):
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry = pair
    room = RoomId(77)
    src, dst = [5, 1, 9], [0, 7, 3]
    _copy_room(pre_bufs, src, dec_bufs, dst)
    inband = _send(prefill, pre_sink, room, src, 600)
    decode.room_received(room, dst, 600, inband)
    decode.batch_done([], [(room, 10)])
    decode.room_finished(room)
    records = dec_sink.wait_for(3)
    assert [(r["stage"], r["verdict"]) for r in records] == [
        ("decode_recv", "match"), ("decode_step", "match"), ("decode_finish", "match")
    ]
    assert decode.tracked() == 0
    value = registry.get_sample_value(
        "dsv4_idxk_probe_rooms_verified_total",
        {**BASE, "stage": "decode_recv", "verdict": "match"},
    )
    assert value == 1.0


def test_digest_results_are_counted_per_stage_and_verdict_room_after_room(pair):
    """Decode keeps each (stage, verdict)'s metric children for its digest results
    (`DecodeMonitor._digest_metrics`): every room is still counted, under its own verdict."""
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry = pair
    rooms = [(RoomId(41), [1, 2], [3, 4]), (RoomId(42), [5, 6], [7, 8])]
    for room, src, dst in rooms:
        _copy_room(pre_bufs, src, dec_bufs, dst)
        decode.room_received(room, dst, 2 * 256, _send(prefill, pre_sink, room, src, 2 * 256))
    dec_sink.wait_for(2)
    dec_bufs[0][8, 3] ^= 0x01  # room 42's second page: its finish mismatches
    for room, _, _ in rooms:
        decode.room_finished(room)
    assert [r["verdict"] for r in dec_sink.wait_for(4)] == ["match", "match", "match", "mismatch"]
    counted = threading.Event()  # the collector counts a record after emitting it: wait for it to be through
    decode.engine.post(lambda _: counted.set())
    assert counted.wait(10)

    def sample(name, **labels):
        return registry.get_sample_value(f"dsv4_idxk_probe_{name}", {**BASE, **labels})

    assert sample("rooms_verified_total", stage="decode_recv", verdict="match") == 2
    assert sample("rooms_verified_total", stage="decode_finish", verdict="match") == 1
    assert sample("rooms_verified_total", stage="decode_finish", verdict="mismatch") == 1
    for stage in ("decode_recv", "decode_finish"):
        assert sample("rooms_digested_total", stage=stage) == 2
        assert sample("verify_latency_seconds_count", stage=stage) == 2
        assert sample("digest_bytes_total", stage=stage) == 2 * 2 * 256 // LAYOUT.tokens_per_slot * len(LAYER_IDS) * (
            sum(seg.slot_bytes for seg in LAYOUT.segments))


def test_prefill_counts_every_batch_it_sends():
    """Prefill keeps its `prefill_send` counters (`PrefillMonitor._send_counters`): every
    batch is still counted, rooms and bytes."""
    registry = CollectorRegistry()
    sink = Sink()
    prefill = PrefillMonitor(DigestEngine(LAYOUT, LAYER_IDS, _buffers(3)), sink, ProbeMetrics(registry, role="prefill"))
    prefill.room_sent(RoomId(1), [0, 1], 2 * 256)
    prefill.rooms_sent([(RoomId(2), [2], 256), (RoomId(3), [3, 4, 5], 3 * 256 - 64)])
    sink.wait_for(3)
    counted = threading.Event()  # the collector counts a batch after emitting its records
    prefill.engine.post(lambda _: counted.set())
    assert counted.wait(10)
    prefill.engine.close()
    labels = {**process_labels(role="prefill"), "stage": "prefill_send"}
    slot_bytes = sum(seg.slot_bytes for seg in LAYOUT.segments)
    slots = (2 * 256 + 256 + 3 * 256 - 64) // LAYOUT.tokens_per_slot
    assert registry.get_sample_value("dsv4_idxk_probe_rooms_digested_total", labels) == 3
    assert registry.get_sample_value("dsv4_idxk_probe_digest_bytes_total", labels) == slots * len(LAYER_IDS) * slot_bytes


def test_change_after_receipt_is_found_at_next_stage_and_localised(pair):
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, _ = pair
    room = RoomId(5, attempt=1)
    src, dst = [2, 4, 6], [8, 9, 10]
    _copy_room(pre_bufs, src, dec_bufs, dst)
    inband = _send(prefill, pre_sink, room, src, 3 * 256)
    decode.room_received(room, dst, 3 * 256, inband)
    dec_sink.wait_for(1)
    dec_bufs[1][dst[2], 8192 + 7] ^= 0x10  # layer id 2, logical page 2, scale segment
    decode.batch_done([], [(room, 10)])
    records = dec_sink.wait_for(2)
    assert records[0]["verdict"] == "match"
    bad = records[1]
    assert (bad["stage"], bad["verdict"], bad["first_divergence"]) == ("decode_step", "mismatch", "decode_step")
    assert bad["localisation"]["layer_segments"] == [[2, "scale"]]
    assert bad["localisation"]["pages"] == [2]


def test_each_record_carries_the_digest_of_its_own_stage(pair):
    """Decode keeps a room's digest record between its stages (`DecodeMonitor._digest_record`):
    a stage whose bytes differ gets its own, one whose bytes are back gets theirs again."""
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, _ = pair
    room, src, dst, n_tokens = RoomId(6), [1, 3], [2, 11], 2 * 256
    _copy_room(pre_bufs, src, dec_bufs, dst)
    inband = _send(prefill, pre_sink, room, src, n_tokens)
    expected = []
    decode.room_received(room, dst, n_tokens, inband)
    expected.append(digest_room(dec_bufs, dst, n_tokens, LAYOUT, LAYER_IDS).to_record())
    dec_sink.wait_for(1)
    dec_bufs[2][dst[1], 5] ^= 0x01  # layer id 4, logical page 1, payload
    decode.batch_done([], [(room, 10)])
    expected.append(digest_room(dec_bufs, dst, n_tokens, LAYOUT, LAYER_IDS).to_record())
    dec_sink.wait_for(2)
    dec_bufs[2][dst[1], 5] ^= 0x01  # back as it was
    decode.room_finished(room)
    expected.append(digest_room(dec_bufs, dst, n_tokens, LAYOUT, LAYER_IDS).to_record())
    records = dec_sink.wait_for(3)
    assert [r["verdict"] for r in records] == ["match", "mismatch", "match"]
    assert [r["digest"] for r in records] == [{**e, "key": room.key} for e in expected]
    assert expected[1]["pages"] != expected[0]["pages"] == expected[2]["pages"]
    assert records[0]["digest"] is not records[2]["digest"]  # a dict of its own per record


def test_non_frozen_tail_bytes_never_matter(pair):
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, _ = pair
    room = RoomId(9)
    n_tokens = 256 + 41  # logical page 1 has 10 frozen slots
    _copy_room(pre_bufs, [0, 1], dec_bufs, [4, 5])
    inband = _send(prefill, pre_sink, room, [0, 1], n_tokens)
    dec_bufs[0][5, 10 * 128] ^= 0xFF  # payload of slot 10: written later by decode
    dec_bufs[0][5, 8192 + 10 * 4] ^= 0xFF  # its scale
    decode.room_received(room, [4, 5], n_tokens, inband)
    assert dec_sink.wait_for(1)[0]["verdict"] == "match"


def test_missing_inband_and_exchange_gives_unverified(pair):
    _, decode, _, _, _, dec_sink, _ = pair
    decode.fetch_vectors = lambda key: None
    decode.room_received(RoomId(1), [0], 256, None)
    record = dec_sink.wait_for(1)[0]
    assert record["verdict"] == "unverified"


def test_failing_exchange_is_counted_and_room_unverified(pair):
    _, decode, _, _, _, dec_sink, registry = pair

    def broken(key):
        raise TimeoutError("peer did not answer")

    decode.fetch_vectors = broken
    decode.room_received(RoomId(2), [0], 256, None)
    assert dec_sink.wait_for(1)[0]["verdict"] == "unverified"
    assert registry.get_sample_value(
        "dsv4_idxk_probe_exchange_errors_total", {**BASE, "kind": "fetch"}
    ) == 1.0


def test_a_room_whose_fetch_failed_asks_again_at_its_next_digests_a_bounded_number_of_times(pair):
    # one slow answer from prefill must not cost the room its localisation for life
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, _ = pair
    room = RoomId(12)
    src, dst = [1, 3], [5, 6]
    _copy_room(pre_bufs, src, dec_bufs, dst)
    inband = _send(prefill, pre_sink, room, src, 2 * 256)
    dec_bufs[0][dst[1], 3] ^= 0x01  # layer id 0, logical page 1, payload: differs at receipt
    asked = []

    def first_fails(key):
        asked.append(key)
        return None if len(asked) == 1 else prefill.lookup(key)

    decode.fetch_vectors = first_fails
    decode.room_received(room, dst, 2 * 256, inband)
    first = dec_sink.wait_for(1)[0]
    assert (first["verdict"], first["localisation"]) == ("mismatch", None)
    decode.batch_done([], [(room, 10)])
    second = dec_sink.wait_for(2)[1]
    assert second["verdict"] == "mismatch" and second["localisation"]["pages"] == [1]
    assert len(asked) == 2

    dead = RoomId(13)
    _copy_room(pre_bufs, src, dec_bufs, [7, 8])
    decode.fetch_vectors = lambda key: asked.append(key)  # a peer that never answers
    asked.clear()
    decode.room_received(dead, [7, 8], 2 * 256, None)
    for step in range(5):
        decode.batch_done([], [(dead, 10 * (step + 1))])
    records = dec_sink.wait_for(2 + 6)[2:]
    assert [r["verdict"] for r in records] == ["unverified"] * 6
    assert asked == [dead.key] * decode_module.MAX_FETCHES_PER_ROOM


def test_signature_difference_is_not_comparable(pair):
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, _ = pair
    inband = _send(prefill, pre_sink, RoomId(3), [0], 256)
    other = InbandDigest(inband.room_digest, inband.signature ^ 1, 256)
    decode.room_received(RoomId(3), [0], 256, other)
    assert dec_sink.wait_for(1)[0]["verdict"] == "not_comparable"


def test_inband_round_trip_and_foreign_slots():
    value = InbandDigest(2**64 - 5, 1234567890123, 4097)
    assert InbandDigest.from_slots(value.to_slots()) == value
    assert InbandDigest.from_slots([0, 0, 0, 0]) is None
    assert InbandDigest.from_slots(np.array(value.to_slots(), dtype=np.uint64)) == value


def test_one_batch_one_launch_with_each_room_judged_on_its_own(pair):
    """batch_done digests every due room of a decode batch in one submit; a change in one
    room is reported for that room alone, and bytes are counted per room."""
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry = pair
    rooms = {RoomId(1): ([0, 1], [2, 3]), RoomId(2): ([4], [5]), RoomId(3): ([6, 7], [8, 9])}
    inbands = {}
    for i, (room, (src, dst)) in enumerate(rooms.items()):
        _copy_room(pre_bufs, src, dec_bufs, dst)
        pending = prefill.room_sent(room, src, 256 * len(src))
        pre_sink.wait_for(i + 1)
        inbands[room] = InbandDigest(int(pending.room_digests[0]), prefill.engine.signature, 256 * len(src))
        decode.room_received(room, dst, 256 * len(src), inbands[room])
    dec_sink.wait_for(3)
    dec_bufs[0][9, 100] ^= 1  # room 3, logical page 1, layer id 0, payload
    submits = []
    real_submit = decode.engine.submit
    decode.engine.submit = lambda reqs, cb, **kw: submits.append([r.key for r in reqs]) or real_submit(reqs, cb, **kw)
    assert [decode.step_due(b) for b in (0, 9, 10, 20)] == [False, False, True, True]
    decode.batch_done([RoomId(1)], [(RoomId(2), 10), (RoomId(3), 10)])
    records = dec_sink.wait_for(6)[3:]
    assert len(submits) == 1 and sorted(submits[0]) == sorted(r.key for r in rooms)
    by_room = {r["room"]: (r["stage"], r["verdict"]) for r in records}
    assert by_room == {"1": ("decode_finish", "match"), "2": ("decode_step", "match"), "3": ("decode_step", "mismatch")}
    bad = next(r for r in records if r["room"] == "3")
    assert bad["localisation"]["layer_segments"] == [[0, "payload"]] and bad["localisation"]["pages"] == [1]
    labels = {**BASE, "stage": "decode_step"}
    frozen_row_bytes = LAYOUT.row_bytes * len(LAYER_IDS)
    assert registry.get_sample_value("dsv4_idxk_probe_digest_bytes_total", labels) == 3 * frozen_row_bytes  # rooms 2 and 3
    assert decode.tracked() == 2  # room 1 finished and is forgotten


def test_a_batch_is_judged_room_by_room_with_the_gil_offered_in_between(pair, monkeypatch):
    """The collector hands the GIL to the serving thread between the rooms of a batch
    (dsv4_idxk_probe.background), so a 64-room batch never holds it for all 64."""
    import dsv4_idxk_probe.pd.decode as decode_module

    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry = pair
    yields = []
    monkeypatch.setattr(decode_module, "yield_to_serving", lambda: yields.append(len(dec_sink.records)))
    rooms = [RoomId(40 + i) for i in range(4)]
    for room in rooms:
        decode.room_received(room, [i for i in range(2)], 512, None)
    dec_sink.wait_for(4)
    yields.clear()
    decode.batch_done(rooms, [])
    dec_sink.wait_for(8)
    assert yields == [5, 6, 7]  # after the batch's first, second and third room, not after its last


def test_page_ids_past_the_buffers_are_not_read_and_not_judged(pair):
    """Issue 16 item 5: a page list naming rows past a buffer (a host page id, a bug)
    gets neither a match nor a mismatch: the kernel reads nothing there."""
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry = pair
    room = RoomId(78)
    src = [5, 1, 9]
    inband = _send(prefill, pre_sink, room, src, 600)
    decode.room_received(room, [0, 7, 40], 600, inband)  # 12 pages per buffer: page 40 does not exist
    record = dec_sink.wait_for(1)[0]
    assert (record["stage"], record["verdict"]) == ("decode_recv", "not_comparable")
    assert "outside the index-K buffers" in record["reason"]


def test_a_record_goes_out_after_its_counts():
    """Whoever sees a room's record (a log tailer, a test) sees its metrics already counted:
    both monitors count before they emit."""
    pre_registry, dec_registry = CollectorRegistry(), CollectorRegistry()
    seen = []

    def counted_at_emit(registry, role):
        def emit(record):
            labels = {**process_labels(role=role), "stage": record["stage"]}
            seen.append((record["stage"], registry.get_sample_value("dsv4_idxk_probe_rooms_digested_total", labels)))
        return emit

    pre_bufs, dec_bufs = _buffers(1), _buffers(2)
    prefill = PrefillMonitor(DigestEngine(LAYOUT, LAYER_IDS, pre_bufs), counted_at_emit(pre_registry, "prefill"),
                             ProbeMetrics(pre_registry, role="prefill"))
    decode = DecodeMonitor(DigestEngine(LAYOUT, LAYER_IDS, dec_bufs), counted_at_emit(dec_registry, "decode"),
                           ProbeMetrics(dec_registry, role="decode"), fetch_vectors=prefill.lookup)
    try:
        _copy_room(pre_bufs, [1, 2], dec_bufs, [3, 4])
        pending = prefill.room_sent(RoomId(5), [1, 2], 512)
        assert pending.wait()
        decode.room_received(RoomId(5), [3, 4], 512, InbandDigest(int(pending.room_digests[0]), prefill.engine.signature, 512))
        decode.room_finished(RoomId(5))
        for engine in (prefill.engine, decode.engine):  # every record out
            done = threading.Event()
            engine.post(lambda _: done.set())
            assert done.wait(10)
    finally:
        prefill.engine.close()
        decode.engine.close()
    assert sorted(seen) == [("decode_finish", 1.0), ("decode_recv", 1.0), ("prefill_send", 1.0)]
