"""The cheap paths a clean room takes with diagnosis on (docs/overhead.md, "With diagnosis on")
leave the same state as the paths they replaced: a matching room's entry renewed rather
than replaced, the serving thread's room events recorded without capture checks, the
allocation snapshot digested without a fold, frozen slot counts clamped without np.clip."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from dsv4_idxk_probe.diagnosis import ContentIndex, PageJournal
from dsv4_idxk_probe.diagnosis.tracker import DecodeDiagnosis
from dsv4_idxk_probe.digest import DigestEngine, get_layout
from dsv4_idxk_probe.digest.room_table import RoomRequest, frozen_slots_per_page

LAYOUT = get_layout("fp8")
LAYERS, PAGES, SEGMENTS = 2, 3, len(LAYOUT.segments)


def _content(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 2**63, (LAYERS, PAGES, SEGMENTS)).astype(np.uint64)


def _state(index: ContentIndex) -> list:
    """Everything a lookup or an eviction reads: each table's rooms in order, their values."""
    return [[(room, e.pages.tolist(), e.content.tolist(), e.frozen.tolist()) for room, e in table.items()]
            for table in (index._held, index._freed, index._before)] + [index.cells, index.evicted]


def _play(index: ContentIndex, renewing: bool) -> None:
    """Rooms matching again and again, one replaced with other content, one evicted: the
    tracker's calls (`renew`, else `hold`), or `hold` every time as before."""
    entries: dict[str, object] = {}
    pages, frozen = np.array([7, 8, 9]), np.array([64, 64, 10], dtype=np.int32)
    script = [("a", 1), ("b", 2), ("a", 1), ("c", 3), ("b", 2), ("a", 4), ("b", 2), ("d", 5), ("a", 4), ("c", 3)]
    for room, seed in script:
        content = _content(seed)
        if renewing and index.renew(room, entries.get(room), content):
            continue
        entries[room] = index.hold(room, pages, content, frozen)


@pytest.mark.parametrize("max_cells", [10_000, 3 * LAYERS * PAGES * SEGMENTS])
def test_renewing_a_matching_rooms_entry_leaves_the_index_as_holding_it_again(max_cells):
    renewed, held = ContentIndex(max_cells), ContentIndex(max_cells)
    _play(renewed, renewing=True)
    _play(held, renewing=False)
    assert _state(renewed) == _state(held)
    # the lookup that names another room lists held rooms newest first: same answer
    probe = int(_content(3)[0, 1, 0])
    assert renewed.find_all(probe, 0) == held.find_all(probe, 0)


def test_renew_refuses_an_entry_the_index_no_longer_holds_or_other_content():
    index = ContentIndex(10_000)
    pages, frozen = np.array([1, 2, 3]), np.full(3, 64, dtype=np.int32)
    entry = index.hold("a", pages, _content(1), frozen)
    assert not index.renew("a", entry, _content(2))  # other content: the caller must hold it
    assert not index.renew("a", None, _content(1))
    assert index.renew("a", entry, _content(1))
    index.release("a")  # now a freed entry: its room no longer holds it
    assert not index.renew("a", entry, _content(1))
    assert index.held_content("a") is None


def test_a_tracked_room_matching_at_every_digest_keeps_one_entry_equal_to_its_content():
    index = ContentIndex(10_000)
    diagnosis = DecodeDiagnosis(LAYOUT, [0, 1], PageJournal(64), index)
    pages = [4, 5, 6]
    diagnosis.allocated("r", pages)
    for t_ns, seed in ((10, 1), (20, 1), (30, 1)):
        assert diagnosis.observe("r", pages, 3 * 256, t_ns, _content(seed), "match", None) is None
    first = index.held_content("r")
    assert diagnosis._tracks["r"].last_good_ns == 30
    assert diagnosis.observe("r", pages, 3 * 256, 40, _content(9), "match", None) is None  # new content: replaced
    assert index.held_content("r") is not first
    assert index.held_content("r").content.tolist() == _content(9).tolist()
    assert len(index) == 1 and index.cells == LAYERS * PAGES * SEGMENTS


def test_room_events_recorded_as_captured_read_as_recorded_ones():
    clock = iter(range(100, 200)).__next__
    plain, captured = PageJournal(16, clock=clock), PageJournal(16, clock=iter(range(100, 200)).__next__)
    for kind, pages, room in (("allocated", [3, 4], "r"), ("transfer_landed", np.array([3, 4]), "r"), ("freed", [3, 4], "r")):
        plain.record(kind, pages, room)
        captured.record_captured(kind, pages, room)
    assert captured.recorded == plain.recorded == 3
    for page in (3, 4, 5):
        assert captured.events_for(page) == plain.events_for(page)
    assert captured.previous_owner(4, 10**9, "other") == plain.previous_owner(4, 10**9, "other") == "r"


def test_frozen_slot_counts_are_the_clamped_division_for_every_page():
    for n_pages in (0, 1, 3, 17):
        for n_tokens in (-300, 0, 1, 3, 4, 255, 256, 257, 3 * 256 - 1, 17 * 256, 10**6):
            starts = np.arange(n_pages) * LAYOUT.page_tokens
            want = np.clip((n_tokens - starts) // LAYOUT.tokens_per_slot, 0, LAYOUT.slots).astype(np.int32)
            got = frozen_slots_per_page(LAYOUT, n_pages, n_tokens)
            assert got.dtype == np.int32 and got.tolist() == want.tolist(), (n_pages, n_tokens)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend", ["reference", "triton"])  # triton: the interpreter without a GPU
def test_a_contents_only_batch_hands_out_the_same_contents_without_digests(backend):
    g = torch.Generator().manual_seed(3)
    buffers = [torch.randint(0, 256, (8, LAYOUT.row_bytes), dtype=torch.uint8, generator=g) for _ in range(LAYERS)]
    if backend == "triton":
        buffers = [b.to(DEVICE) for b in buffers]
    engine = DigestEngine(LAYOUT, list(range(LAYERS)), buffers, backend=backend, rows=2)
    rooms = [RoomRequest("a", [1, 2, 3], 2 * 256 + 40), RoomRequest("outside", [5, 99], 300)]
    got, done = {}, threading.Event()
    engine.submit(rooms, lambda batch: got.__setitem__("full", batch))
    engine.submit(rooms, lambda batch: (got.__setitem__("contents", batch), done.set()), contents_only=True)
    assert done.wait(30)
    engine.close()
    full, contents = got["full"], got["contents"]
    assert contents.error is None and contents.digests == [] and len(full.digests) == 2
    assert contents.out_of_range == full.out_of_range and contents.out_of_range[1] > 0
    assert [c.tolist() for c in contents.contents] == [c.tolist() for c in full.contents]
    assert engine.stats.completed_rooms == 4 and engine.stats.out_of_range_rooms == 2
