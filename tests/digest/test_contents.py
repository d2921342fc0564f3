"""Content digests: each cell's segment digest d, stored by the kernel beside its cells,
handed out per room by the engine, and independent of where the bytes sit."""

import threading

import numpy as np
import pytest
import torch

from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, get_layout
from dsv4_idxk_probe.digest import reference as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _results(layout, layer_ids, buffers, rooms):
    """BatchResult of one submit per backend: {"triton": ..., "reference": ...}."""
    out = {}
    for backend, bufs in (("triton", [b.to(DEVICE) for b in buffers]), ("reference", [b.cpu() for b in buffers])):
        engine = DigestEngine(layout, layer_ids, bufs, backend=backend, rows=2)
        got, done = [], threading.Event()
        engine.submit(rooms, lambda batch: (got.append(batch), done.set()))
        assert done.wait(60)
        engine.close()
        out[backend] = got[0]
    return out


def test_engine_hands_out_each_rooms_contents_as_the_reference_defines_them(layout, random_buffers):
    buffers = random_buffers(layout, 3, 6, seed=5)
    rooms = [RoomRequest("tail", torch.tensor([4, 1], device=DEVICE), 256 + 37),
             RoomRequest("empty", torch.tensor([], dtype=torch.int64, device=DEVICE), 0),
             RoomRequest("host", [0, 5, 2], 3 * 256)]
    results = _results(layout, [2, 5, 9], buffers, rooms)
    host = [b.cpu() for b in buffers]
    for backend, batch in results.items():
        assert len(batch.contents) == len(rooms), backend
        for room, contents in zip(rooms, batch.contents):
            pages = room.pages.cpu().numpy() if isinstance(room.pages, torch.Tensor) else room.pages
            want = ref.room_contents(host, pages, room.n_tokens, layout)
            assert contents.dtype == np.uint64 and contents.shape == (3, len(pages), len(layout.segments))
            assert np.array_equal(contents, want), (backend, room.key)


def test_the_same_bytes_have_the_same_content_anywhere_and_different_cells(random_buffers):
    """A page copied into another layer's buffer at another physical page, read as another
    logical page of another room: same content digest, different cell contribution."""
    layout = get_layout("fp8")
    buffers = random_buffers(layout, 2, 4, seed=6)
    buffers[1][3] = buffers[0][1]
    rooms = [RoomRequest("a", torch.tensor([1, 0], device=DEVICE), 2 * 256),
             RoomRequest("b", torch.tensor([2, 3], device=DEVICE), 2 * 256)]
    batch = _results(layout, [0, 1], buffers, rooms)["triton"]
    a, b = batch.contents
    assert np.array_equal(a[0, 0], b[1, 1])  # layer 0 logical 0 of room a == layer 1 logical 1 of room b
    assert not np.array_equal(a[0, 0], a[0, 1])
    assert batch.digests[0].layer_segment[0].tolist() != batch.digests[1].layer_segment[1].tolist()


def test_a_zeroed_page_shows_the_zero_cell_content(layout, random_buffers):
    buffers = random_buffers(layout, 2, 4, seed=7)
    buffers[1][2] = 0
    rooms = [RoomRequest("z", torch.tensor([0, 2], device=DEVICE), 256 + 9)]
    for backend, batch in _results(layout, [0, 1], buffers, rooms).items():
        contents = batch.contents[0]
        for s in range(len(layout.segments)):
            assert int(contents[1, 1, s]) == ref.zero_content_digest(layout, s, 9 // layout.tokens_per_slot), backend
            assert int(contents[0, 1, s]) != ref.zero_content_digest(layout, s, 9 // layout.tokens_per_slot)


def test_zero_cell_content_depends_on_the_frozen_slots_and_is_zero_with_none(layout):
    for s in range(len(layout.segments)):
        values = {ref.zero_content_digest(layout, s, n) for n in (1, 2, 7, layout.slots)}
        assert len(values) == 4 and 0 not in values
        assert ref.zero_content_digest(layout, s, 0) == 0
    with pytest.raises(ValueError, match="no segment"):
        ref.zero_content_digest(layout, len(layout.segments), 1)
    with pytest.raises(ValueError, match="frozen_slots"):
        ref.zero_content_digest(layout, 0, layout.slots + 1)


def test_contents_outlive_the_staging_buffer_they_were_stored_in(random_buffers):
    """The staging buffer is reused by the next batch; the contents a callback kept stay."""
    layout = get_layout("fp4")
    buffers = [b.to(DEVICE) for b in random_buffers(layout, 2, 4, seed=8)]
    engine = DigestEngine(layout, [0, 1], buffers, backend="triton")
    got = []
    for pages in ([0, 1], [2, 3], [3, 0]):
        done = threading.Event()
        engine.submit([RoomRequest("r", torch.tensor(pages, device=DEVICE), 2 * 256)],
                      lambda batch: (got.append(batch.contents[0]), done.set()))
        assert done.wait(60)
    engine.close()
    host = [b.cpu() for b in buffers]
    for kept, pages in zip(got, ([0, 1], [2, 3], [3, 0])):
        assert np.array_equal(kept, ref.room_contents(host, pages, 2 * 256, layout))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_an_engine_without_contents_hands_out_none_and_the_same_digests(layout, random_buffers, backend):
    """Without diagnosis the contents stay on the GPU (their copy down is spared); the
    digests and the out-of-range flags, which sit before them, come down whole."""
    buffers = random_buffers(layout, 3, 6, seed=11)
    bufs = [b.to(DEVICE) for b in buffers] if backend == "triton" else buffers
    rooms = [RoomRequest("a", torch.tensor([4, 1], device=DEVICE if backend == "triton" else "cpu"), 256 + 37),
             RoomRequest("b", [0, 5, 99], 3 * 256)]  # 99: out of range, flagged
    batches = {}
    for contents in (True, False):
        engine = DigestEngine(layout, [2, 5, 9], bufs, backend=backend, contents=contents)
        got, done = [], threading.Event()
        engine.submit(rooms, lambda batch: (got.append(batch), done.set()))
        assert done.wait(60)
        engine.close()
        batches[contents] = got[0]
    assert batches[False].contents == () and len(batches[True].contents) == 2
    assert batches[False].out_of_range == batches[True].out_of_range == (0, 3)
    kept, spared = batches[True].digests[0], batches[False].digests[0]
    assert np.array_equal(kept.pages, spared.pages) and np.array_equal(kept.layer_segment, spared.layer_segment)


def test_both_output_places_give_the_references_digests_contents_and_flags(layout, random_buffers):
    """`outputs="device"` (tables copied up, outputs down) and `"pinned"` (the kernel reads
    and stores the pinned buffer) are two routes to the same bytes: several rooms (the
    room table read), host and device page tables, an out-of-range id."""
    buffers = random_buffers(layout, 3, 6, seed=13)
    rooms = [RoomRequest("dev", torch.tensor([4, 1, 3], device=DEVICE), 2 * 256 + 9),
             RoomRequest("host", [0, 5, 99], 3 * 256), RoomRequest("one", [2], 256)]
    reference = _results(layout, [2, 5, 9], buffers, rooms)["reference"]
    for outputs in ("device", "pinned"):
        engine = DigestEngine(layout, [2, 5, 9], [b.to(DEVICE) for b in buffers], backend="triton", outputs=outputs)
        got, done = [], threading.Event()
        engine.submit(rooms, lambda batch: (got.append(batch), done.set()))
        assert done.wait(60)
        engine.submit(rooms[2:], lambda batch: (got.append(batch), done.set()))  # one room, by value
        engine.close()
        batch, alone = got[0], got[-1]
        assert batch.out_of_range == reference.out_of_range == (0, 3, 0), outputs
        for mine, want in zip(batch.digests, reference.digests):
            assert (mine.room, list(mine.pages)) == (want.room, list(want.pages)), (outputs, mine.key)
        assert all(np.array_equal(a, b) for a, b in zip(batch.contents, reference.contents)), outputs
        assert alone.digests[0].room == reference.digests[2].room, outputs
