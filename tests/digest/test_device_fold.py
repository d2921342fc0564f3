"""The kernel folds each room's cells on the device; only the folds come down.

Under TRITON_INTERPRET=1 the Triton backend runs the real kernel (its atomics
included) on CPU tensors, with the staging buffer's twin a second host buffer,
so the folds, their offsets, the zeroing between batches and the flags fetched
for rows out of range are the GPU's code paths. Every result is compared with
the reference backend, which folds the reference cells on the host.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, get_layout
from dsv4_idxk_probe.digest.launch import FOLD_SLICES, fold_words

LAYOUT = get_layout("fp8")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU, the CUDA paths (events, streams)


def _results(engine: DigestEngine, batches: list[list[RoomRequest]]) -> list:
    """Each batch's `BatchResult`, submitted one after another (each waited for, so the
    next may reuse its staging buffer)."""
    out = []
    for rooms in batches:
        got = []
        engine.submit(rooms, got.append)
        engine.close()  # delivers what is pending; the next submit starts the collector again
        out.append(got[0])
    return out


def _same(result, expected) -> None:
    assert result.error is None and expected.error is None
    assert result.out_of_range == expected.out_of_range
    assert result.room_bytes == expected.room_bytes
    for got, want, outside in zip(result.digests, expected.digests, result.out_of_range, strict=True):
        assert got.key == want.key and got.n_tokens == want.n_tokens
        assert np.array_equal(got.layer_segment, want.layer_segment)
        assert np.array_equal(got.pages, want.pages)
        assert (got.signature == want.signature) == (not outside)  # rows not read: a signature of its own
    for got, want in zip(result.contents, expected.contents, strict=True):
        assert np.array_equal(got, want)


def _batches(n_pages: int) -> list[list[RoomRequest]]:
    """Ragged rooms, one and several per launch, tail pages, page ids on the host and in
    tensors (int32, int64), and rooms with ids past the buffer and negative."""
    return [
        [RoomRequest("big", list(range(n_pages)) * 3, n_pages * 3 * 256)],
        [RoomRequest("a", [5, 1, 4], 700), RoomRequest("b", torch.tensor([2, 3], dtype=torch.int32), 300),
         RoomRequest("c", torch.tensor([7], dtype=torch.int64), 64)],
        [RoomRequest("tail", [0, 6, 2, 2], 3 * 256 + 17)],
        [RoomRequest("past", [1, n_pages + 3, 2], 600), RoomRequest("fine", [3], 256)],
        [RoomRequest("negative", torch.tensor([-1, 4], dtype=torch.int64), 400)],
        [RoomRequest("one", [6], 256)],
    ]


@pytest.mark.parametrize("download", ["submit", "collector"])
@pytest.mark.parametrize("contents", [True, False])
def test_folds_on_the_device_equal_the_reference_batch_after_batch(random_buffers, download, contents):
    """Batch after batch through the same staging buffers: a fold left unzeroed by the
    batch before, a wrong offset, a lost page or layer entry, or a wrong count of rows
    not read would each make a digest (or the room's bytes) differ from the reference."""
    buffers = random_buffers(LAYOUT, 3, 8, seed=21)
    batches = _batches(8)
    expected = _results(DigestEngine(LAYOUT, [0, 4, 9], buffers, backend="reference", contents=contents), batches)
    engine = DigestEngine(LAYOUT, [0, 4, 9], [b.to(DEVICE) for b in buffers], backend="triton", contents=contents,
                          download=download)
    assert engine._fold
    got = _results(engine, batches + batches)  # twice: every buffer reused at least once
    for result, want in zip(got, expected + expected, strict=True):
        _same(result, want)


def test_only_the_folds_come_down_without_diagnosis(random_buffers):
    """Without contents, the copy down the collector makes is the rooms' folds alone: a
    page vector, a (layer, segment) matrix and a count per room, not every cell and flag
    (a 43 x 1024-page fp8 room: 9 KB, not 750 KB)."""
    buffers = [b.to(DEVICE) for b in random_buffers(LAYOUT, 2, 8, seed=3)]
    engine = DigestEngine(LAYOUT, [0, 1], buffers, backend="triton", contents=False, download="collector")
    rooms = [RoomRequest("a", [1, 2, 3], 700), RoomRequest("b", [4, 5], 400)]
    ticket = engine.submit(rooms, lambda _: None)
    start, end = ticket.download
    assert end - start == 8 * fold_words([3, 2], 2, len(LAYOUT.segments)) == 8 * (5 + 2 * (2 * 2 + 1))
    one = engine.submit_room("c", [6, 7, 0, 1], 1000, lambda _: None)
    start, end = one.download  # one room: its matrix in FOLD_SLICES copies
    assert end - start == 8 * fold_words([4], 2, len(LAYOUT.segments)) == 8 * (4 + FOLD_SLICES * 2 * 2 + 1)
    engine.close()


def test_a_batch_whose_rows_are_out_of_range_fetches_its_flags_for_the_bytes_it_read(random_buffers):
    """The flags stay on the device unless a room has rows out of range; then the collector
    copies them down, so the bytes counted as digested leave out exactly the rows not read."""
    buffers = random_buffers(LAYOUT, 2, 8, seed=4)
    rooms = [[RoomRequest("past", [1, 99, 2, 99], 4 * 256), RoomRequest("clean", [3, 4], 512)]]
    want, = _results(DigestEngine(LAYOUT, [0, 1], buffers, backend="reference", contents=False), rooms)
    got, = _results(DigestEngine(LAYOUT, [0, 1], [b.to(DEVICE) for b in buffers], backend="triton", contents=False,
                                 download="collector"), rooms)
    assert got.out_of_range == want.out_of_range == (4, 0)
    assert got.room_bytes == want.room_bytes and got.room_bytes[0] < got.room_bytes[1] * 2


class _Event:
    """Stands in for a CUDA event: done once told."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_buffer_goes_back_to_its_pool_only_once_its_zeroing_is_done(random_buffers):
    """On a GPU the zeroing is queued on the collector's stream; the buffer must not be
    found by a submit before the GPU has run it, nor kept out of the pool after."""
    engine = DigestEngine(LAYOUT, [0], random_buffers(LAYOUT, 1, 4, seed=5), backend="triton")  # CPU: no warm-up
    first, second = engine._staging.take(1024), engine._staging.take(1024)
    events = [_Event(), _Event()]
    engine._zeroing.extend(zip(events, (first, second)))
    engine._reclaim()
    assert engine._staging.min_free == [] and len(engine._zeroing) == 2
    events[1].done = True  # a later one done first: still in order, nothing given back
    engine._reclaim()
    assert engine._staging.min_free == []
    events[0].done = True
    engine._reclaim()
    assert engine._staging.min_free == [first, second] and not engine._zeroing


@pytest.mark.parametrize("contents", [True, False])
def test_the_collector_zeroes_behind_its_copy_down_where_that_copy_covers_what_the_batch_wrote(random_buffers,
                                                                                               contents):
    """With content digests on, the collector's copy down reaches the end of what a batch
    wrote, so it zeroes the twin behind that copy and gives the buffer straight back (no
    separate zeroing, its event and queries); without them the flags stay on the device
    for a later fetch, and the zeroing waits for the batch's delivery (`_zero`). Either
    way the buffer comes back zero where the batch wrote."""
    buffers = [b.to(DEVICE) for b in random_buffers(LAYOUT, 2, 8, seed=6)]
    engine = DigestEngine(LAYOUT, [0, 1], buffers, backend="triton", contents=contents, download="collector")
    zeroed_later = []
    zero = engine._zero
    engine._zero = lambda staging, nbytes: (zeroed_later.append(nbytes), zero(staging, nbytes))
    got = []
    ticket = engine.submit([RoomRequest("a", [1, 2, 3], 700), RoomRequest("b", [4, 99], 400)], got.append)
    staging = ticket.staging
    engine.close()
    assert got[0].error is None and got[0].out_of_range == (0, 2)
    assert ticket.zeroed == contents and (zeroed_later == []) == contents
    if DEVICE == "cuda":
        torch.cuda.synchronize()  # a zeroing queued on the collector's stream (`_zero`) is done
    engine._reclaim()
    assert any(buffer is staging for buffer in engine._staging.min_free)
    assert ticket.used > 0 and not staging.device[: ticket.used].any()
