"""DigestEngine: asynchronous delivery, bounded queue, fail-open callbacks."""

import re
import threading

import pytest
import torch

from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, get_layout

LAYOUT = get_layout("fp8")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["reference", "triton"])
def engine(request, random_buffers):
    buffers = random_buffers(LAYOUT, 2, 4, seed=1)
    if request.param == "triton":
        buffers = [b.to(DEVICE) for b in buffers]
    e = DigestEngine(LAYOUT, [0, 1], buffers, backend=request.param)
    yield e
    e.close()


def test_results_arrive_on_the_collector_thread(engine):
    got, done = [], threading.Event()

    def callback(batch):
        got.append((threading.current_thread().name, batch))
        done.set()

    pending = engine.submit([RoomRequest("a", [1, 2], 300), RoomRequest("b", [3], 256)], callback)
    assert done.wait(10)
    thread, batch = got[0]
    assert thread == "dsv4-idxk-digest"
    assert [d.key for d in batch.digests] == ["a", "b"]
    assert [int(v) for v in pending.room_digests] == [d.room for d in batch.digests]
    assert batch.rows == 2 * 3  # layers x pages
    assert batch.bytes_digested == (64 + 11 + 64) * 2 * 132  # frozen slots x layers x bytes per slot


def test_full_queue_drops_instead_of_waiting(random_buffers):
    engine = DigestEngine(LAYOUT, [0], random_buffers(LAYOUT, 1, 2, seed=2), max_pending=1)
    gate = threading.Event()
    engine.submit([RoomRequest("first", [0], 256)], lambda b: gate.wait(10))
    results = [engine.submit([RoomRequest(f"r{i}", [1], 256)], lambda b: None) for i in range(5)]
    assert None in results
    assert engine.stats.dropped_batches == results.count(None) >= 1
    gate.set()
    engine.close()


def test_raising_callback_is_counted_and_collection_continues(engine):
    done = threading.Event()
    engine.submit([RoomRequest("a", [0], 256)], lambda b: 1 / 0)
    engine.submit([RoomRequest("b", [0], 256)], lambda b: done.set())
    assert done.wait(10)
    assert engine.stats.callback_errors == 1


def test_snapshot_is_taken_at_submit(random_buffers):
    """Bytes changed after submit do not leak into the result (host path digests at submit)."""
    buffers = random_buffers(LAYOUT, 1, 2, seed=3)
    engine = DigestEngine(LAYOUT, [0], buffers)
    first = engine.digest_now([RoomRequest("a", [1], 256)])[0]
    gate, got = threading.Event(), []
    engine.submit([RoomRequest("a", [1], 256)], lambda b: (got.append(b.digests[0]), gate.set()))
    buffers[0][1, 0] ^= 1
    assert gate.wait(10)
    assert got[0].room == first.room
    engine.close()


@pytest.mark.parametrize(
    "buffers, message",
    [
        ([torch.zeros((2, 100), dtype=torch.uint8)], "needs uint8 [pages, 8448]"),
        ([torch.zeros((2, 8448), dtype=torch.int8)], "needs uint8"),
        ([torch.zeros((8448, 2), dtype=torch.uint8).t()], "not contiguous"),
    ],
)
def test_bad_buffers_are_refused_with_the_layer_named(buffers, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        DigestEngine(LAYOUT, [7], buffers)
    assert "layer 7" in str(err.value)
