"""Coverage accounting of PD rooms (docs/coverage.md): every room decode tracked is counted
once, when it stops being tracked, into coverage_bytes{path="pd", outcome, reason} with
its bytes; a clean run reads 100% verified, and each way a room goes unverified names
its reason."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from prometheus_client import CollectorRegistry
from tests.support.recordsink import Sink

from dsv4_idxk_probe import safety
from dsv4_idxk_probe.digest import DigestEngine, get_layout
from dsv4_idxk_probe.metrics.definitions import ProbeMetrics, process_labels
from dsv4_idxk_probe.pd import DecodeMonitor, InbandDigest, PrefillMonitor, RoomId
from dsv4_idxk_probe.vocabulary import COVERAGE_OUTCOMES, COVERAGE_REASONS

BASE = process_labels(role="decode")
LAYER_IDS = [0, 2, 4]
LAYOUT = get_layout("fp8")
PAGE_BYTES = LAYOUT.row_bytes * len(LAYER_IDS)  # a full page's frozen index-K over the room's layers
COVERAGE = "dsv4_idxk_probe_coverage_bytes_total"


def _buffers(seed: int, pages: int = 12, layers=LAYER_IDS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (pages, LAYOUT.row_bytes), dtype=torch.uint8, generator=g) for _ in layers]


def _copy_room(src, src_pages, dst, dst_pages):
    for s, d in zip(src, dst):
        d[dst_pages] = s[src_pages]


@pytest.fixture
def pair():
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, role="decode")
    metrics.zero_pd_series()
    pre_bufs, dec_bufs = _buffers(1), _buffers(2)
    pre_sink, dec_sink = Sink(), Sink()
    prefill = PrefillMonitor(DigestEngine(LAYOUT, LAYER_IDS, pre_bufs), pre_sink)
    decode = DecodeMonitor(DigestEngine(LAYOUT, LAYER_IDS, dec_bufs), dec_sink, metrics,
                           fetch_vectors=prefill.lookup, step_interval=10)
    yield prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry
    prefill.engine.close()
    decode.engine.close()


def _send(prefill, pre_sink, room, pages, n_tokens) -> InbandDigest:
    n = len(pre_sink.records)
    pending = prefill.room_sent(room, pages, n_tokens)
    pre_sink.wait_for(n + 1)
    return InbandDigest(int(pending.room_digests[0]), prefill.engine.signature, n_tokens)


def _settled(decode) -> None:
    """Wait until the collector has handled everything submitted so far."""
    done = threading.Event()
    decode.engine.post(lambda _: done.set())
    assert done.wait(10)


def _launch_fails(*args, **kwargs):
    """A digest launch that raises (a device or launcher error)."""
    raise RuntimeError("launch failed")


def _coverage(registry) -> dict[tuple[str, str], float]:
    """(outcome, reason) -> bytes counted on path pd, leaving out the zero series."""
    out = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == COVERAGE and sample.labels["path"] == "pd" and sample.value:
                out[(sample.labels["outcome"], sample.labels["reason"])] = sample.value
    return out


def test_a_clean_run_reads_every_byte_verified_once_per_room(pair):
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry = pair
    rooms = {RoomId(1): ([0, 1], [4, 5], 512), RoomId(2): ([2, 3, 6], [7, 8, 9], 600)}
    for room, (src, dst, n_tokens) in rooms.items():
        _copy_room(pre_bufs, src, dec_bufs, dst)
        decode.room_received(room, dst, n_tokens, _send(prefill, pre_sink, room, src, n_tokens))
    dec_sink.wait_for(2)
    _settled(decode)
    assert _coverage(registry) == {}  # still tracked: counted when they end, with their final outcome
    decode.batch_done([], [(room, 10) for room in rooms])
    decode.batch_done(list(rooms), [])
    dec_sink.wait_for(6)
    _settled(decode)
    received = registry.get_sample_value("dsv4_idxk_probe_digest_bytes_total", {**BASE, "stage": "decode_recv"})
    assert received > 0
    assert _coverage(registry) == {("verified", "none"): received}  # each room once, not once per stage
    assert registry.get_sample_value("dsv4_idxk_probe_mismatch_unlocalised_total", {**BASE, "stage": "decode_recv"}) == 0


def test_a_mismatch_is_verified_bytes_found_bad_and_an_unlocalised_one_is_counted(pair):
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry = pair
    room = RoomId(3)
    _copy_room(pre_bufs, [0, 1], dec_bufs, [4, 5])
    inband = _send(prefill, pre_sink, room, [0, 1], 512)
    dec_bufs[1][5, 9] ^= 0x40
    decode.fetch_vectors = lambda key: None  # prefill's vectors cannot be fetched
    decode.room_received(room, [4, 5], 512, inband)
    decode.room_finished(room)
    records = dec_sink.wait_for(2)
    assert [(r["verdict"], r["localisation"]) for r in records] == [("mismatch", None)] * 2
    _settled(decode)
    assert _coverage(registry) == {("verified", "none"): 2 * PAGE_BYTES}
    for stage in ("decode_recv", "decode_finish"):
        assert registry.get_sample_value("dsv4_idxk_probe_mismatch_unlocalised_total", {**BASE, "stage": stage}) == 1


def test_a_localised_mismatch_is_not_counted_unlocalised(pair):
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry = pair
    room = RoomId(4)
    _copy_room(pre_bufs, [0], dec_bufs, [4])
    inband = _send(prefill, pre_sink, room, [0], 256)
    dec_bufs[0][4, 9] ^= 0x40
    decode.room_received(room, [4], 256, inband)
    assert dec_sink.wait_for(1)[0]["localisation"] is not None
    _settled(decode)
    assert registry.get_sample_value("dsv4_idxk_probe_mismatch_unlocalised_total", {**BASE, "stage": "decode_recv"}) == 0


@pytest.mark.parametrize("case, expected", [
    ("no_prefill_digest", ("unverified", "no_exchange")),
    ("signature_differs", ("not_comparable", "layout_differs")),
    ("prefill_sent_fewer_tokens", ("not_comparable", "truncated_by_transfer")),
    ("prefill_sent_more_tokens", ("not_comparable", "length_differs")),
])
def test_each_unverified_room_names_its_reason(pair, case, expected):
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry = pair
    room = RoomId(5)
    _copy_room(pre_bufs, [0, 1], dec_bufs, [4, 5])
    n_tokens = 512
    if case == "no_prefill_digest":
        inband = None
        decode.fetch_vectors = None
    else:
        sent = _send(prefill, pre_sink, room, [0, 1], n_tokens)
        decode.fetch_vectors = None  # judged in band
        inband = {
            "signature_differs": InbandDigest(sent.room_digest, sent.signature ^ 1, n_tokens),
            "prefill_sent_fewer_tokens": InbandDigest(sent.room_digest, sent.signature, n_tokens - 256),
            "prefill_sent_more_tokens": InbandDigest(sent.room_digest, sent.signature, n_tokens + 256),
        }[case]
    decode.room_received(room, [4, 5], n_tokens, inband)
    decode.room_finished(room)
    dec_sink.wait_for(2)
    _settled(decode)
    assert _coverage(registry) == {expected: 2 * PAGE_BYTES}


def test_a_pipeline_stages_digest_against_the_whole_model_reads_pp_stage(pair):
    _, decode, _, dec_bufs, _, dec_sink, registry = pair
    stage_bufs = _buffers(3, layers=LAYER_IDS[:2])
    stage_sink = Sink()
    stage = PrefillMonitor(DigestEngine(LAYOUT, LAYER_IDS[:2], stage_bufs), stage_sink)  # PP stage 0 of 2
    try:
        room = RoomId(6)
        _copy_room(stage_bufs, [0], dec_bufs, [4])
        stage.room_sent(room, [0], 256)
        stage_sink.wait_for(1)
        decode.fetch_vectors = stage.lookup
        decode.room_received(room, [4], 256, None)
        decode.room_finished(room)
        assert [r["verdict"] for r in dec_sink.wait_for(2)] == ["not_comparable"] * 2
        _settled(decode)
        assert _coverage(registry) == {("not_comparable", "pp_stage"): PAGE_BYTES}
    finally:
        stage.engine.close()


def test_a_pipeline_stages_digest_in_band_alone_reads_pp_stage(pair):
    _, decode, _, dec_bufs, _, dec_sink, registry = pair
    stage_bufs = _buffers(3, layers=LAYER_IDS[1:])
    stage_sink = Sink()
    stage = PrefillMonitor(DigestEngine(LAYOUT, LAYER_IDS[1:], stage_bufs), stage_sink)  # PP stage 1 of 2
    try:
        room = RoomId(16)
        inband = _send(stage, stage_sink, room, [0], 256)
        decode.fetch_vectors = None
        decode.room_received(room, [4], 256, inband)
        decode.room_finished(room)
        assert [r["verdict"] for r in dec_sink.wait_for(2)] == ["not_comparable"] * 2
        _settled(decode)
        assert _coverage(registry) == {("not_comparable", "pp_stage"): PAGE_BYTES}
    finally:
        stage.engine.close()


def test_a_room_verified_at_receipt_then_retracted_stays_verified(pair):
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry = pair
    room = RoomId(7)
    _copy_room(pre_bufs, [0], dec_bufs, [4])
    decode.room_received(room, [4], 256, _send(prefill, pre_sink, room, [0], 256))
    dec_sink.wait_for(1)
    decode.room_skipped(room, "retracted", stage="decode_step")
    dec_sink.wait_for(2)
    _settled(decode)
    assert _coverage(registry) == {("verified", "none"): PAGE_BYTES}


def test_a_room_received_again_while_tracked_keeps_its_first_transfer_counted(pair):
    """A tracked room's key received a second time (a rebootstrap after a retraction no
    hook saw): the first transfer gets its closing record and its bytes, the second its own."""
    from dsv4_idxk_probe.pd.decode import RECEIVED_AGAIN

    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry = pair
    room = RoomId(7)
    _copy_room(pre_bufs, [0, 1], dec_bufs, [4, 5])
    decode.room_received(room, [4, 5], 512, _send(prefill, pre_sink, room, [0, 1], 512))
    dec_sink.wait_for(1)
    _copy_room(pre_bufs, [2, 3, 6], dec_bufs, [7, 8, 9])
    decode.room_received(room, [7, 8, 9], 700, _send(prefill, pre_sink, room, [2, 3, 6], 700))
    decode.room_finished(room)
    _settled(decode)
    records = [(r["stage"], r["verdict"], r.get("reason", "")) for r in dec_sink.records]
    assert ("decode_step", "skipped", RECEIVED_AGAIN) in records
    assert [r[:2] for r in records].count(("decode_recv", "match")) == 2
    second = registry.get_sample_value("dsv4_idxk_probe_digest_bytes_total", {**BASE, "stage": "decode_finish"})
    assert _coverage(registry) == {("verified", "none"): 2 * PAGE_BYTES + second}  # both transfers, once each
    assert decode.tracked() == 0


def test_a_room_evicted_while_its_finish_digest_runs_has_one_last_verdict(pair):
    """The table's oldest room is often one that just finished, its finish digest still
    queued: evicting it must not add a `skipped` record after that verdict."""
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry = pair
    decode.max_rooms = 1
    first, second = RoomId(1), RoomId(2)
    _copy_room(pre_bufs, [0, 1], dec_bufs, [4, 5])
    decode.room_received(first, [4, 5], 512, _send(prefill, pre_sink, first, [0, 1], 512))
    inband = _send(prefill, pre_sink, second, [2, 3], 512)
    _settled(decode)
    gate = threading.Event()
    decode.engine.post(lambda _: gate.wait(10))  # the collector behind a slow batch
    decode.room_finished(first)
    decode.room_received(second, [7, 8], 512, inband)  # over the bound: the finishing room is evicted
    gate.set()
    _settled(decode)
    verdicts = [(r["stage"], r["verdict"]) for r in dec_sink.records if r["room"] == "1"]
    assert verdicts == [("decode_recv", "match"), ("decode_finish", "match")]


@pytest.mark.parametrize("how", ["alone", "in_a_batch"])
def test_a_room_whose_finish_digest_cannot_be_launched_is_counted_and_forgotten(pair, monkeypatch, how):
    """A launch that raises (a device or launcher error; the hook's guard swallows it) must
    not leave the finished room in the table, where an eviction passes finished rooms over
    and it would never be counted: it is counted with the outcome it had (verified at its
    receipt here), and the failure is counted as the probe's error."""
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry = pair
    room = RoomId(1)
    _copy_room(pre_bufs, [0, 1], dec_bufs, [4, 5])
    decode.room_received(room, [4, 5], 512, _send(prefill, pre_sink, room, [0, 1], 512))
    dec_sink.wait_for(1)
    _settled(decode)
    errors = safety.error_counts().get("decode.digest_submit", 0)

    monkeypatch.setattr(decode.engine, "submit_room", _launch_fails)
    monkeypatch.setattr(decode.engine, "submit", _launch_fails)
    try:
        decode.room_finished(room) if how == "alone" else decode.batch_done([room], [])
    except RuntimeError:  # what the hook's guard would swallow
        pass
    _settled(decode)
    received = registry.get_sample_value("dsv4_idxk_probe_digest_bytes_total", {**BASE, "stage": "decode_recv"})
    assert _coverage(registry) == {("verified", "none"): received}
    assert decode._get(room) is None
    assert safety.error_counts().get("decode.digest_submit", 0) == errors + 1


def test_a_room_whose_receipt_digest_cannot_be_launched_is_still_tracked_and_counted(pair, monkeypatch):
    """The receipt's launch raises: the room stays tracked (its finish digest may still come)
    with `skipped`/`probe_error` folded; when it ends it is counted with its best outcome."""
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry = pair
    room = RoomId(4)
    _copy_room(pre_bufs, [0, 1], dec_bufs, [4, 5])
    inband = _send(prefill, pre_sink, room, [0, 1], 512)
    errors = safety.error_counts().get("decode.digest_submit", 0)
    submit_room = decode.engine.submit_room

    monkeypatch.setattr(decode.engine, "submit_room", _launch_fails)
    assert decode.room_received(room, [4, 5], 512, inband) is None
    state = decode._get(room)
    assert state is not None and (state.coverage.outcome, state.coverage.reason) == ("skipped", "probe_error")
    assert safety.error_counts().get("decode.digest_submit", 0) == errors + 1
    monkeypatch.setattr(decode.engine, "submit_room", submit_room)
    decode.room_finished(room)
    dec_sink.wait_for(1)
    _settled(decode)
    assert [(r["stage"], r["verdict"]) for r in dec_sink.records if r["room"] == "4"] == [("decode_finish", "match")]
    assert list(_coverage(registry)) == [("verified", "none")]


def test_a_finished_room_whose_last_verdict_fails_in_the_probe_is_recorded_and_counted(pair, monkeypatch):
    """Judging the finish digest raises (a probe defect, caught and counted): the room still gets
    its stage's record (`skipped`, digest failed) and is forgotten and counted with its best
    outcome. It stayed in the table before, and the table's eviction passed it over as
    finished: its bytes were counted nowhere."""
    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry = pair
    decode.max_rooms = 1
    room, other = RoomId(1), RoomId(2)
    _copy_room(pre_bufs, [0], dec_bufs, [4])
    decode.room_received(room, [4], 256, _send(prefill, pre_sink, room, [0], 256))
    dec_sink.wait_for(1)
    _settled(decode)
    errors = safety.error_counts().get("decode.on_result", 0)

    def judging_fails(state, digest):
        raise RuntimeError("a probe defect while judging")

    monkeypatch.setattr(decode, "_judge", judging_fails)
    decode.room_finished(room)
    _settled(decode)
    monkeypatch.undo()
    assert safety.error_counts().get("decode.on_result", 0) == errors + 1
    assert decode._get(room) is None  # forgotten with its last digest
    assert [(r["stage"], r["verdict"]) for r in dec_sink.records if r["room"] == "1"] == [
        ("decode_recv", "match"), ("decode_finish", "skipped")]
    _copy_room(pre_bufs, [1], dec_bufs, [5])  # later traffic: a table of one evicts whatever is left
    decode.room_received(other, [5], 256, _send(prefill, pre_sink, other, [1], 256))
    decode.room_finished(other)
    _settled(decode)
    assert _coverage(registry) == {("verified", "none"): 2 * PAGE_BYTES}  # room 1 verified at its receipt


def test_a_fold_on_the_serving_thread_and_one_on_the_collector_take_turns(pair, monkeypatch):
    """A full digest queue folds `skipped` into a room on the serving thread while the collector
    may fold that room's verdict: each fold reads, then writes. Forced to switch threads in
    between, the two must not lose the verified outcome to `queue_full`."""
    from dsv4_idxk_probe.pd import coverage as coverage_module

    prefill, decode, pre_bufs, dec_bufs, pre_sink, dec_sink, registry = pair
    room = RoomId(9)
    _copy_room(pre_bufs, [0], dec_bufs, [4])
    decode.room_received(room, [4], 256, _send(prefill, pre_sink, room, [0], 256))
    dec_sink.wait_for(1)
    _settled(decode)
    state = decode._get(room)
    state.coverage = None  # as before its first verdict
    rank = coverage_module.RANK

    def slow_fold(self, outcome, reason, nbytes=None):  # the fold's read and write, a switch between
        take = self.outcome is None or rank[outcome] > rank[self.outcome]
        time.sleep(0.1 if outcome == "skipped" else 0.01)  # the serving thread's write comes last
        if take:
            self.outcome, self.reason = outcome, reason

    monkeypatch.setattr(coverage_module.RoomCoverage, "fold", slow_fold)
    serving = threading.Thread(target=decode._dropped, args=([(state, "decode_step", 1)], 0))
    serving.start()
    time.sleep(0.01)
    decode._cover(state, "match", "", None, PAGE_BYTES)
    serving.join()
    assert state.coverage.outcome == "verified"


def test_rooms_never_verified_are_counted_skipped_with_their_reason_and_bytes(pair):
    _, decode, _, _, _, dec_sink, registry = pair
    host_receive = "received into the HiCache host pool (host-receive); not verified"
    decode.room_skipped(RoomId(8), host_receive, n_tokens=512)
    decode.room_skipped(RoomId(9), "transfer failed: peer gone", n_tokens=256)
    decode.room_skipped(RoomId(10), "health check", n_tokens=256)  # moves no index-K: not counted
    # tracked, then retracted before its receipt digest came back
    decode.engine.submit_room = lambda *a, **k: None  # the digest queue is full
    decode.room_received(RoomId(11), [4], 256, None)
    decode.room_skipped(RoomId(11), "retracted", stage="decode_step")
    dec_sink.wait_for(4)
    _settled(decode)
    assert _coverage(registry) == {("skipped", "host_dest"): 2 * PAGE_BYTES,
                                   ("skipped", "transfer_failed"): PAGE_BYTES,
                                   ("skipped", "queue_full"): PAGE_BYTES}


def test_decode_zeroes_every_pd_coverage_series_and_prefill_none():
    from dsv4_idxk_probe.metrics.definitions import PD_COVERAGE

    decode = CollectorRegistry()
    ProbeMetrics(decode, role="decode").zero_pd_series()
    prefill = CollectorRegistry()
    ProbeMetrics(prefill, role="prefill").zero_pd_series()
    labels = lambda registry: {(s.labels["outcome"], s.labels["reason"]) for f in registry.collect()
                               for s in f.samples if s.name == COVERAGE}
    assert labels(decode) == {(o, r) for o, reasons in PD_COVERAGE.items() for r in reasons}
    assert ("verified", "none") in labels(decode)
    assert labels(prefill) == set()
    assert all(o in COVERAGE_OUTCOMES and r in COVERAGE_REASONS for o, r in labels(decode))


def test_every_skip_reason_the_hooks_write_has_a_coverage_reason():
    from dsv4_idxk_probe.pd.coverage import skip_reason
    from dsv4_idxk_probe.sglang.accessors import HOST_RECEIVE

    assert skip_reason(HOST_RECEIVE) == "host_dest"
    for text, reason in (("retracted", "retracted"), ("aborted", "aborted"), ("transfer failed", "transfer_failed"),
                         ("evicted: tracking table full", "evicted"), ("digest failed: boom", "probe_error"),
                         ("retracted before this digest ran", "retracted"), ("something new", "other")):
        assert skip_reason(text) == reason and reason in COVERAGE_REASONS
    assert skip_reason("health check") is None and skip_reason("fake bootstrap host") is None
