"""Diagnosis through the decode monitor over host buffers (reference backend).

Each test plays a room's life on decode memory as SGLang would (pages
allocated, the transfer lands, decode steps, pages freed and reused) and
breaks it the way one of the rig's fault kinds does; the room record must
name what the bad cells became and the page events behind them.
"""

from __future__ import annotations

import threading

import pytest
import torch
from prometheus_client import CollectorRegistry
from tests.support.recordsink import Sink

from dsv4_idxk_probe.diagnosis import ContentIndex, PageJournal
from dsv4_idxk_probe.diagnosis.journal import PageGroups
from dsv4_idxk_probe.diagnosis.tracker import DecodeDiagnosis
from dsv4_idxk_probe.digest import DigestEngine, get_layout
from dsv4_idxk_probe.digest.room_table import RoomRequest
from dsv4_idxk_probe.metrics.definitions import ProbeMetrics, process_labels
from dsv4_idxk_probe.pd import DecodeMonitor, InbandDigest, PrefillMonitor, RoomId

LAYER_IDS = [0, 2, 4]
LAYOUT = get_layout("fp8")
FULL = 3 * 256  # three full pages


def _buffers(seed: int, pages: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (pages, LAYOUT.row_bytes), dtype=torch.uint8, generator=g) for _ in LAYER_IDS]


class Bed:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.metrics = ProbeMetrics(self.registry, role="decode")
        self.metrics.zero_pd_series()
        self.pre, self.dec = _buffers(1), _buffers(2)
        self.pre_sink, self.sink = Sink(), Sink()
        self.journal = PageJournal(capacity=256)
        self.diagnosis = DecodeDiagnosis(LAYOUT, LAYER_IDS, self.journal, ContentIndex(100_000))
        self.prefill = PrefillMonitor(DigestEngine(LAYOUT, LAYER_IDS, self.pre), self.pre_sink)
        self.decode = DecodeMonitor(DigestEngine(LAYOUT, LAYER_IDS, self.dec), self.sink, self.metrics,
                                    fetch_vectors=self.prefill.lookup, step_interval=1,
                                    diagnosis=self.diagnosis, snapshot_on_allocation=True)
        self.sent = 0

    def close(self):
        self.prefill.engine.close()
        self.decode.engine.close()

    def receive(self, room: RoomId, src, dst, n_tokens=FULL, drop=()):
        """Allocate `dst`, send from `src`, land every page but the `drop`ped logical ones."""
        self.decode.room_allocated(room, dst, n_tokens)
        pending = self.prefill.room_sent(room, src, n_tokens)
        self.sent += 1
        self.pre_sink.wait_for(self.sent)
        inband = InbandDigest(int(pending.room_digests[0]), self.prefill.engine.signature, n_tokens)
        for k, (s, d) in enumerate(zip(src, dst)):
            if k not in drop:
                for a, b in zip(self.pre, self.dec):
                    b[d] = a[s]
        self.decode.room_received(room, dst, n_tokens, inband)

    def records(self, room: RoomId, n: int):
        return self.sink.wait_for(n, room=str(room.room))

    def diagnoses(self, kind: str) -> float:
        return self.registry.get_sample_value(
            "dsv4_idxk_probe_diagnoses_total", {**process_labels(role="decode"), "stage": "decode_step", "kind": kind})


@pytest.fixture
def bed():
    b = Bed()
    yield b
    b.close()


def _bad(record):
    assert record["verdict"] == "mismatch", record
    return record["diagnosis"]


def test_a_zeroed_page_after_receipt_is_named_zeroed_exactly(bed):
    room = RoomId(1)
    bed.receive(room, [1, 2, 3], [4, 5, 6])
    assert bed.records(room, 1)[0]["verdict"] == "match"
    bed.dec[1][5].zero_()  # layer 2, logical page 1
    bed.decode.batch_done([], [(room, 1)])
    cells = _bad(bed.records(room, 2)[1])
    assert {(c["layer"], c["page"], c["segment"], c["kind"]) for c in cells} == {
        (2, 1, "payload", "zeroed"), (2, 1, "scale", "zeroed")}
    assert all(c["physical_page"] == 5 and c.get("exact", True) for c in cells)
    assert bed.diagnoses("zeroed") == 2 and bed.diagnoses("unknown") == 0


def test_swapped_pages_name_each_other_as_the_other_room(bed):
    a, b = RoomId(10), RoomId(11)
    bed.receive(a, [1, 2, 3], [4, 5, 6])
    bed.receive(b, [7, 8, 9], [10, 11, 12])
    bed.records(a, 1), bed.records(b, 1)
    for buf in bed.dec[:1]:  # layer 0: A's page 2 <-> B's page 0
        row = buf[6].clone()
        buf[6] = buf[10]
        buf[10] = row
    bed.decode.batch_done([], [(a, 1), (b, 1)])
    cells_a = _bad(bed.records(a, 2)[1])
    cells_b = _bad(bed.records(b, 2)[1])
    assert {c["kind"] for c in cells_a + cells_b} == {"other_room"}
    assert {(c["layer"], c["page"]) for c in cells_a} == {(0, 2)}
    assert {(r["room"], r["page"]) for c in cells_a for r in c["rooms"]} == {(b.key, 0)}
    assert {(r["room"], r["page"]) for c in cells_b for r in c["rooms"]} == {(a.key, 2)}


def test_a_swap_partner_that_never_matched_is_still_named_by_its_good_pages(bed):
    """The partner's own fault (a zeroed page at receipt) keeps it from ever matching;
    its other pages were verified by the localisation, so a page of theirs found in
    another room still names it (as the SGLang rig's shipped faults do)."""
    a, b = RoomId(12), RoomId(13)
    bed.receive(a, [1, 2, 3], [4, 5, 6])
    bed.dec[1][10].zero_()  # B's logical page 0, layer 2: B mismatches at receipt
    bed.receive(b, [7, 8, 9], [13, 11, 12], drop=(0,))
    bed.dec[1][13].zero_()
    assert bed.records(a, 1)[0]["verdict"] == "match"
    assert _bad(bed.records(b, 1)[0])
    for buf in bed.dec[:1]:  # layer 0: A's page 2 <-> B's page 1
        row = buf[6].clone()
        buf[6] = buf[11]
        buf[11] = row
    bed.decode.batch_done([], [(a, 1)])
    cells_a = _bad(bed.records(a, 2)[1])
    assert {(c["layer"], c["page"], c["kind"]) for c in cells_a} == {(0, 2, "other_room")}
    assert {(r["room"], r["page"]) for c in cells_a for r in c["rooms"]} == {(b.key, 1)}


def test_a_write_that_never_landed_shows_the_previous_occupant_and_its_events(bed):
    old, new = RoomId(20), RoomId(21)
    bed.receive(old, [1, 2, 3], [4, 5, 6])
    bed.decode.room_finished(old)  # pages 4, 5, 6 freed with old's bytes in them
    assert [r["verdict"] for r in bed.records(old, 2)] == ["match", "match"]
    bed.receive(new, [7, 8, 9], [6, 5, 4], drop=(1,))  # physical 5 keeps old's logical page 1
    cells = _bad(bed.records(new, 1)[0])
    assert {c["kind"] for c in cells} == {"previous_occupant"}
    assert {(c["page"], c["physical_page"]) for c in cells} == {(1, 5)}
    assert {r["room"] for c in cells for r in c["rooms"]} == {old.key}
    events = [(e["event"], e.get("room")) for e in cells[0]["events"]]
    assert events[-3:] == [("freed", old.key), ("allocated", new.key), ("transfer_landed", new.key)]


def test_a_room_freed_before_the_collector_ran_its_snapshot_keeps_its_earlier_bytes(bed):
    """A short room can be allocated, received, finished and freed on the serving thread
    while the collector is still behind: its allocation snapshot must still serve the
    diagnosis of its digests, which the collector runs after it (the SGLang rig's
    drop_page fault read `unknown` when the snapshot was dropped as "room already freed")."""
    gate = threading.Event()
    bed.decode.engine.submit([RoomRequest("collector-busy", [0], 0)], lambda _: gate.wait(10))
    room = RoomId(30)
    bed.receive(room, [1, 2, 3], [7, 8, 9], drop=(1,))  # physical 8 keeps the bytes it held before
    bed.decode.room_finished(room)
    gate.set()
    cells = _bad(bed.records(room, 2)[0])
    assert {(c["page"], c["physical_page"], c["kind"]) for c in cells} == {(1, 8, "previous_occupant")}
    assert bed.diagnosis.index.before_content(room.key) is None  # retired with the room, not kept


def test_a_flipped_bit_is_unknown_with_the_hicache_load_that_preceded_it(bed):
    room = RoomId(30)
    bed.receive(room, [1, 2, 3], [4, 5, 6])
    bed.records(room, 1)
    host_rows = torch.arange(40 * 256, 41 * 256)  # host row 40 loaded into device page 6
    bed.journal.record("hicache_load", PageGroups(torch.arange(6 * 256, 7 * 256), 256),
                       host_rows=PageGroups(host_rows, 256), layer=0, detail={"pool": "deepseek_v4_c4_indexer"})
    bed.dec[2][6][100] ^= 0x10
    bed.decode.batch_done([], [(room, 1)])
    cells = _bad(bed.records(room, 2)[1])
    assert [(c["layer"], c["page"], c["segment"], c["kind"]) for c in cells] == [(4, 2, "payload", "unknown")]
    assert [(e["event"], e.get("host_row")) for e in cells[0]["events"]] == [("hicache_load", 40)]


def test_a_mismatch_at_receipt_is_diagnosed_within_the_localisation(bed):
    room = RoomId(40)
    bed.receive(room, [1, 2, 3], [4, 5, 6], drop=())
    bed.records(room, 1)
    other = RoomId(41)
    bed.dec[0][9].zero_()
    bed.receive(other, [7, 8, 9], [9, 10, 11], drop=(0,))  # physical 9 was zero before the WRITE
    cells = _bad(bed.records(other, 1)[0])
    assert {(c["layer"], c["page"], c["kind"]) for c in cells if c["layer"] == 0} == {(0, 0, "zeroed")}
    others = [c for c in cells if c["layer"] != 0]  # the stale layers of page 9 held the old random bytes
    assert others and {c["kind"] for c in others} == {"previous_occupant"}
    assert all(c["events"][-1]["event"] == "transfer_landed" for c in cells)


def test_diagnosis_off_leaves_records_without_it(bed):
    decode = DecodeMonitor(DigestEngine(LAYOUT, LAYER_IDS, bed.dec), Sink())
    room = RoomId(50)
    decode.room_allocated(room, [4, 5, 6], FULL)  # nothing to do, nothing raised
    decode.room_received(room, [4, 5, 6], FULL, None)
    record = decode.emit.wait_for(1)[0]
    decode.engine.close()
    assert "diagnosis" not in record and record["verdict"] == "unverified"


def test_diff_and_report_show_the_diagnosis_beside_the_localisation(bed, tmp_path):
    import io

    from dsv4_idxk_probe.cli.diff import print_summary
    from dsv4_idxk_probe.offline.join import analyse
    from dsv4_idxk_probe.offline.report_html import render
    from dsv4_idxk_probe.roomlog.lineformat import encode_line

    a, b = RoomId(60), RoomId(61)
    bed.receive(a, [1, 2, 3], [4, 5, 6])
    bed.receive(b, [7, 8, 9], [10, 11, 12])
    bed.records(a, 1), bed.records(b, 1)
    bed.journal.record("hicache_load", [4, 10], host_rows=[7, 8], layer=0)  # as the HiCache hooks record one
    bed.dec[0][4].zero_()
    bed.dec[1][10].zero_()
    bed.decode.batch_done([a, b], [])
    bed.records(a, 2), bed.records(b, 2)
    (tmp_path / "prefill.jsonl").write_bytes(b"".join(encode_line(r) for r in bed.pre_sink.records))
    (tmp_path / "decode.jsonl").write_bytes(b"".join(encode_line(r) for r in bed.sink.records))
    analysis = analyse([tmp_path / "prefill.jsonl", tmp_path / "decode.jsonl"])
    out = io.StringIO()
    print_summary(analysis, 10, out)
    text = out.getvalue()
    assert "diagnosis: 4 cells zeroed after a HiCache load" in text, text
    assert analysis.summary()["diagnosis"]["cells"] == {"zeroed": 4}
    row = next(line for line in text.splitlines() if line.startswith("60/0"))
    assert "zeroed x2 after hicache_load" in row and "decode_finish" in row
    page = render(analysis)
    assert 'class="diagnosis"' in page and "zeroed" in page


def test_without_live_localisation_decode_names_suspects_and_the_diff_completes_the_cells(bed, tmp_path):
    """The prefill vectors did not come (exchange down): decode knows only that the room
    digest differs. Its record carries the zeroed suspects and each page's events; the diff,
    which localises from prefill's log, names every bad cell."""
    from dsv4_idxk_probe.offline.join import analyse
    from dsv4_idxk_probe.roomlog.lineformat import encode_line

    bed.decode.fetch_vectors = None
    room = RoomId(70)
    bed.receive(room, [1, 2, 3], [4, 5, 6])  # lands, then is hit before decode looks
    record = bed.records(room, 1)[0]
    assert record["verdict"] == "match"
    other = RoomId(71)
    bed.decode.room_allocated(other, [7, 8, 9], FULL)
    pending = bed.prefill.room_sent(other, [10, 11, 12], FULL)
    bed.sent += 1
    bed.pre_sink.wait_for(bed.sent)
    for a, b in zip(bed.pre, bed.dec):
        b[[7, 8, 9]] = a[[10, 11, 12]]
    bed.dec[0][8].zero_()  # layer 0, logical page 1: zeroed
    bed.dec[2][9][17] ^= 1  # layer 4, logical page 2: a flipped bit
    inband = InbandDigest(int(pending.room_digests[0]), bed.prefill.engine.signature, FULL)
    bed.decode.room_received(other, [7, 8, 9], FULL, inband)
    live = bed.records(other, 1)[0]
    assert live["localisation"] is None and live["verdict"] == "mismatch"
    assert {(c["layer"], c["page"], c["kind"]) for c in live["diagnosis"]} == {(0, 1, "zeroed")}
    assert set(live["page_events"]) == {"0", "1", "2"}
    (tmp_path / "p.jsonl").write_bytes(b"".join(encode_line(r) for r in bed.pre_sink.records))
    (tmp_path / "d.jsonl").write_bytes(b"".join(encode_line(r) for r in bed.sink.records))
    stage = analyse([tmp_path / "p.jsonl", tmp_path / "d.jsonl"]).rooms[("71", 0)].first_divergence
    got = {(c["layer"], c["page"], c["segment"]): c for c in stage.diagnosis}
    assert {k: c["kind"] for k, c in got.items() if c.get("exact", True)} == {}  # 2 pages x 2 layer-segments: a bound
    assert got[(0, 1, "payload")]["kind"] == "zeroed" and got[(4, 2, "payload")]["kind"] == "unknown"
    assert [e["event"] for e in got[(4, 2, "payload")]["events"]] == ["allocated", "transfer_landed"]
