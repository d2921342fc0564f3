"""The diagnosis parts on their own: content digests, the journal, the index, summaries."""

from __future__ import annotations

import numpy as np
import torch

from dsv4_idxk_probe.diagnosis import ContentIndex, PageJournal, content_digests, summarise, zero_cell_digests
from dsv4_idxk_probe.diagnosis.journal import PageGroups
from dsv4_idxk_probe.digest import DigestEngine, get_layout, reference
from dsv4_idxk_probe.digest.room_table import RoomRequest

LAYOUT = get_layout("fp8")


def test_content_read_back_from_cell_contributions_equals_the_engines_contents():
    g = torch.Generator().manual_seed(5)
    bufs = [torch.randint(0, 256, (8, LAYOUT.row_bytes), dtype=torch.uint8, generator=g) for _ in range(2)]
    engine = DigestEngine(LAYOUT, [3, 7], bufs)
    got = []
    engine.submit([RoomRequest("r", [5, 1, 2], 600)], got.append)
    engine.close()
    cells = reference.room_cells(bufs, [5, 1, 2], 600, LAYOUT, [3, 7])
    assert np.array_equal(content_digests(cells, [3, 7]), got[0].contents[0])
    assert np.array_equal(got[0].contents[0], reference.room_contents(bufs, [5, 1, 2], 600, LAYOUT))


def test_the_same_bytes_in_another_layer_and_page_have_the_same_content_digest():
    row = np.random.default_rng(1).integers(0, 256, (1, LAYOUT.row_bytes), dtype=np.uint8)
    bufs = [torch.from_numpy(np.repeat(row, 4, axis=0)) for _ in range(2)]
    contents = reference.room_contents(bufs, [0, 3], 512, LAYOUT)
    assert (contents == contents[0, 0]).all()
    zero = zero_cell_digests(LAYOUT, [64, 10, 0])
    assert zero[2].tolist() == [0, 0] and zero[0, 0] != zero[1, 0]


def test_journal_is_bounded_and_finds_a_pages_events_in_a_window():
    t = iter(range(1, 10_000))
    journal = PageJournal(capacity=4, per_page=2, clock=lambda: next(t))
    journal.record("allocated", [1, 2], "a")  # t=1, pushed out below
    journal.record("transfer_landed", np.array([1, 2]), "a")  # t=2
    journal.record("hicache_backup", PageGroups(torch.arange(2 * 64, 3 * 64), 64), host_rows=PageGroups(torch.arange(64), 64))
    journal.record("freed", torch.tensor([1, 2]), "a")  # t=4
    journal.record("allocated", [2], "b")  # t=5
    assert len(journal) == 4
    assert [e["event"] for e in journal.events_for(2)] == ["freed", "allocated"]  # newest two, oldest first
    assert [e["event"] for e in journal.events_for(2, since_ns=2, until_ns=4, limit=8)] == ["hicache_backup", "freed"]
    assert journal.events_for(2, since_ns=2, until_ns=3)[0]["host_row"] == 0
    assert journal.events_for(1, until_ns=1) == []  # its allocation was pushed out
    assert journal.previous_owner(2, before_ns=5, not_room="b") == "a"


def test_content_index_keeps_its_cell_bound_dropping_freed_rooms_first():
    index = ContentIndex(max_cells=3 * 2 * 2 * 2)  # two rooms of 3 layers x 2 pages x 2 segments
    content = np.arange(12, dtype=np.uint64).reshape(3, 2, 2)
    index.hold("a", [1, 2], content, [64, 64])
    index.hold("b", [3, 4], content + 100, [64, 64])
    index.release("a")
    index.hold("c", [5, 6], content + 200, [64, 64])
    assert index.cells <= index.max_cells and index.held_content("a") is None and len(index) == 2
    assert [f.room for f in index.find_all(105, 1)] == ["b"]
    assert index.find_all(5, 1) == []  # a's content went with it


def test_summary_lines_count_kinds_with_their_last_event():
    lines = summarise([
        {"kind": "zeroed", "events": [{"event": "allocated"}, {"event": "hicache_load"}]},
        {"kind": "zeroed", "events": [{"event": "hicache_load"}]},
        {"kind": "other_room", "events": []},
    ])
    assert lines == ["2 cells zeroed after a HiCache load", "1 cell holds another room's page"]



def test_a_log_line_with_a_malformed_diagnosis_is_skipped_naming_the_field(tmp_path):
    from dsv4_idxk_probe.offline.join import analyse
    from dsv4_idxk_probe.pd.records import room_record
    from dsv4_idxk_probe.roomlog.lineformat import encode_line

    def record(room, diagnosis):
        r = room_record(role="decode", stage="decode_recv", room=room, attempt=0, digest=None, layout="fp8",
                        verdict="mismatch")
        r["diagnosis"] = diagnosis
        return encode_line(r)

    good = [{"layer": 1, "page": 0, "segment": "payload", "kind": "zeroed", "events": [{"event": "freed", "t_ns": 5}]}]
    lines = [record(1, good), record(2, [{"layer": 1, "page": 0, "segment": "payload", "kind": "gone"}]),
             record(3, [{"layer": "x", "page": 0, "segment": "payload", "kind": "zeroed"}]),
             record(4, [{"layer": 1, "page": 0, "segment": "payload", "kind": "zeroed", "events": [{"event": 7}]}]),
             record(5, "nope")]
    (tmp_path / "d.jsonl").write_bytes(b"".join(lines))
    analysis = analyse([tmp_path / "d.jsonl"])
    assert set(analysis.rooms) == {("1", 0)} and analysis.n_errors == 4
    text = "\n".join(analysis.errors)
    for field in ("diagnosis[0].kind", "diagnosis[0].layer", "diagnosis[0].events[0].event", "diagnosis must be a list"):
        assert field in text, text
