"""DigestEngine: asynchronous delivery, bounded queue, fail-open callbacks."""

import gc
import re
import threading
import time
import weakref

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


def test_a_batch_whose_result_cannot_be_made_is_dropped_and_its_callback_told(engine, monkeypatch):
    """The collector's own part can fail too (the fold, the flags' copy down on a device
    error): the batch is counted dropped and its callback gets the error, as for a failed
    event; a caller waiting for its rooms (decode's room tickets) is never left waiting."""
    settled = threading.Event()
    engine.submit([RoomRequest("first", [0], 256)], lambda batch: settled.set())  # behind the warm-up batch
    assert settled.wait(30)
    monkeypatch.setattr(engine, "_finish", lambda ticket: 1 / 0)
    got, done = [], threading.Event()
    pending = engine.submit([RoomRequest("a", [0], 256)], lambda batch: (got.append(batch), done.set()))
    assert done.wait(10)
    assert got[0].error.startswith("ZeroDivisionError") and got[0].digests == []
    assert (engine.stats.dropped_batches, engine.stats.callback_errors) == (1, 0)
    assert pending.error is not None and not pending.ready()


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


def test_page_tables_from_host_and_device_mix_in_one_batch(random_buffers):
    """Page lists, NumPy arrays and tensors on the buffers' device go in one launch (host ones
    travel in the staging upload); each room's digest equals the reference's, room bytes too."""
    import numpy as np

    from dsv4_idxk_probe.digest.reference import digest_room

    buffers = [b.to(DEVICE) for b in random_buffers(LAYOUT, 3, 9, seed=5)]
    engine = DigestEngine(LAYOUT, [0, 3, 7], buffers, backend="triton")
    rooms = [
        RoomRequest("list", [4, 2, 8], 2 * 256 + 9),
        RoomRequest("device", torch.tensor([1, 5], dtype=torch.int32, device=DEVICE), 300),
        RoomRequest("numpy", np.array([6, 3, 0, 7]), 4 * 256),
        RoomRequest("empty", [], 0),
    ]
    got, done = [], threading.Event()
    pending = engine.submit(rooms, lambda batch: (got.append(batch), done.set()))
    assert done.wait(30)
    host = [b.cpu() for b in buffers]
    for room, digest, room_bytes in zip(rooms, got[0].digests, got[0].room_bytes):
        pages = room.pages.cpu().numpy() if isinstance(room.pages, torch.Tensor) else room.pages
        want = digest_room(host, pages, room.n_tokens, LAYOUT, [0, 3, 7], key=room.key)
        assert (digest.key, digest.room, list(digest.pages)) == (room.key, want.room, list(want.pages))
        assert room_bytes == 3 * 132 * sum(min(64, max(0, (room.n_tokens - 256 * k) // 4)) for k in range(len(pages)))
    assert [int(v) for v in pending.room_digests] == [d.room for d in got[0].digests]
    engine.close()


def test_page_tables_the_engine_converts_stay_alive_until_their_kernel_ran(random_buffers):
    """Device page tables that are not contiguous int32/int64 (int16 here, a strided view)
    are converted for the kernel. The copies must live until the kernel has read them: in a
    batch, one room's copy freed before the launch is reused by the next room's (they all
    read the last room's pages); a one-room submit's copy must not be offered for reuse
    (`PendingDigest.table`), since the caller keeps only its own tensor."""
    from dsv4_idxk_probe.digest.reference import digest_room

    buffers = [b.to(DEVICE) for b in random_buffers(LAYOUT, 2, 16, seed=9)]
    engine = DigestEngine(LAYOUT, [0, 1], buffers, backend="triton", contents=False)
    ids = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3], [2, 3, 8, 4, 6, 2, 6, 4]]
    strided = torch.tensor([[i, 0] for i in ids[1]], dtype=torch.int64, device=DEVICE)[:, 0]
    rooms = [RoomRequest("int16", torch.tensor(ids[0], dtype=torch.int16, device=DEVICE), 8 * 256),
             RoomRequest("strided", strided, 8 * 256),
             RoomRequest("int16-b", torch.tensor(ids[2], dtype=torch.int16, device=DEVICE), 8 * 256)]
    got, done = [], threading.Event()
    engine.submit(rooms, lambda batch: (got.append(batch), done.set()))
    assert done.wait(30)
    host = [b.cpu() for b in buffers]
    want = [digest_room(host, pages, 8 * 256, LAYOUT, [0, 1], key=room.key).room for room, pages in zip(rooms, ids)]
    assert [d.room for d in got[0].digests] == want
    one = engine.submit_room("one", rooms[0].pages, 8 * 256, lambda batch: None)
    assert one.table is None  # a converted copy's address: never handed out
    kept = engine.submit_room("kept", torch.tensor(ids[0], dtype=torch.int64, device=DEVICE), 8 * 256,
                              lambda batch: None)
    assert kept.table is not None  # the caller's own tensor, read in place, may be read again
    engine.close()


def test_warm_up_batch_is_collected_but_not_counted(random_buffers):
    """The start-up launch (run at construction on CUDA; called by hand here) goes through
    the collector, so its buffers are recycled, and never shows in the room counts."""
    engine = DigestEngine(LAYOUT, [0, 1], [b.to(DEVICE) for b in random_buffers(LAYOUT, 2, 4, seed=3)], backend="triton")
    engine._warm_up()
    done = threading.Event()
    engine.submit([RoomRequest("real", [1, 2], 300)], lambda batch: done.set())
    assert done.wait(30)
    engine.close()
    assert (engine.stats.submitted_rooms, engine.stats.completed_rooms, engine.stats.callback_errors) == (1, 1, 0)


def _engine_with_full_queue(random_buffers):
    """A Triton-backend engine of queue size 1: the collector is held inside its first
    callback until `gate` is set, and a second batch fills the queue."""
    engine = DigestEngine(LAYOUT, [0], [b.to(DEVICE) for b in random_buffers(LAYOUT, 1, 2, seed=2)],
                          backend="triton", max_pending=1)
    deadline = time.monotonic() + 60  # on CUDA the start-up batch holds the one place until collected
    while engine.backlog() and time.monotonic() < deadline:
        time.sleep(0.01)
    started, gate = threading.Event(), threading.Event()
    engine.submit([RoomRequest("first", [0], 256)], lambda b: started.set() or gate.wait(10))
    assert started.wait(10)  # the collector holds "first"; the queue's one place is free
    engine.submit([RoomRequest("queued", [0], 256)], lambda b: None)
    return engine, gate


def test_a_full_queue_drops_before_anything_is_launched(random_buffers):
    engine, gate = _engine_with_full_queue(random_buffers)
    launched = []
    real_launch = engine._launch
    engine._launch = lambda rooms, cb: launched.append(rooms) or real_launch(rooms, cb)
    assert engine.submit([RoomRequest("dropped", [1], 256)], lambda b: None) is None
    assert launched == [] and engine.stats.dropped_batches == 1
    gate.set()
    engine.close()


def test_a_batch_launched_while_another_thread_fills_the_queue_is_still_delivered(random_buffers):
    """Between the size check and the hand-off another thread can fill the queue: the
    launched batch goes in anyway (the bound is exceeded by one), because the GPU may
    still write its staging buffer and its rooms must get their verdicts."""
    engine, gate = _engine_with_full_queue(random_buffers)
    other = engine._tickets.items.popleft()  # room left at the check...
    real_launch, delivered = engine._launch, threading.Event()

    def launch_while_the_other_thread_submits(rooms, callback):
        ticket = real_launch(rooms, callback)
        engine._tickets.put(other)  # ...and none once launched
        return ticket

    engine._launch = launch_while_the_other_thread_submits
    pending = engine.submit([RoomRequest("raced", [1], 256)], lambda b: delivered.set())
    assert pending is not None and engine.stats.dropped_batches == 0
    assert len(engine._tickets.items) == 2  # one over the bound
    gate.set()
    assert delivered.wait(30)
    engine.close()
    assert pending.staging is None  # given back once done


def test_a_room_with_out_of_range_page_ids_is_counted_and_matches_nothing(engine):
    """Engine buffers have 4 pages. Rows at ids -1 and 4 are not read: the batch result
    counts them per room, the bytes digested leave them out, the error is counted, and
    the room's digest compares equal to no digest, not even another such digest of the
    same bytes; the in-band room digest does not give it away either. A clean room in
    the same batch is untouched."""
    from dsv4_idxk_probe.digest import compare
    from dsv4_idxk_probe.safety import error_counts

    errors_before = error_counts().get("digest.page_out_of_range", 0)
    pages = [1, -1, 2, 4]
    if engine.backend == "triton":
        pages = torch.tensor(pages, dtype=torch.int32, device=DEVICE)
    rooms = [RoomRequest("bad", pages, 3 * 256 + 40), RoomRequest("good", [1, 2], 300)]
    got = []
    first = engine.submit(rooms, got.append)
    second = engine.submit(rooms, got.append)
    engine.close()
    assert [b.out_of_range for b in got] == [(2 * 2, 0), (2 * 2, 0)]  # 2 layers x 2 bad pages, then none
    batch = got[0]
    bad, good = batch.digests
    assert bad.signature != engine.signature and good.signature == engine.signature
    assert compare(bad, got[1].digests[0]).verdict == "not_comparable"
    assert compare(good, got[1].digests[1]).verdict == "match"
    assert first.room_digests[0] != second.room_digests[0] and first.room_digests[1] == second.room_digests[1]
    # frozen slots per layer: pages 0 and 2 (64 each) read, page 1 (64) and 3 (10) not
    assert batch.room_bytes == ((64 + 64) * 2 * 132, (64 + 11) * 2 * 132)
    assert engine.stats.out_of_range_rooms == 2 and engine.stats.out_of_range_rows == 8
    assert error_counts().get("digest.page_out_of_range", 0) == errors_before + 2


def test_the_start_up_batch_takes_no_place_of_a_callers_batch(random_buffers):
    """The start-up batch (queued at construction on CUDA) waits in the queue beside the
    callers' batches; a queue of one place still takes a caller's batch beside it."""
    engine, gate = _engine_with_full_queue(random_buffers)
    engine._tickets.items.popleft()  # the queued batch gone: the queue's one place is free again
    engine._warm_up()  # queued behind the collector, which still holds "first"
    assert engine.backlog() == 1
    delivered = threading.Event()
    assert engine.submit([RoomRequest("real", [1], 256)], lambda b: delivered.set()) is not None
    assert engine.stats.dropped_batches == 0
    gate.set()
    assert delivered.wait(30)
    engine.close()
    assert engine.stats.completed_rooms == 2  # "first" and "real"; the start-up batch counts no room


def test_an_engine_from_the_config_hands_out_contents_only_to_decode_with_diagnosis(random_buffers):
    from dsv4_idxk_probe.config import parse_config

    buffers = random_buffers(LAYOUT, 1, 2, seed=4)
    for diagnosis in (False, True):
        config = parse_config({"diagnosis": {"enabled": diagnosis},
                               "digest": {"collector_wait": "poll", "outputs": "pinned"}})
        for role in ("prefill", "decode"):
            engine = DigestEngine.from_config(LAYOUT, [0], buffers, config, role=role)
            assert engine.contents == (diagnosis and role == "decode"), (diagnosis, role)
            assert (engine.wait, engine.outputs) == ("poll", "pinned")


@pytest.mark.parametrize("setting", ["auto", "off"])
def test_the_kernel_is_a_dependent_launch_only_on_gpus_that_have_them_and_not_when_off(setting, random_buffers):
    """`dependent_launch`: "auto" makes the kernel a programmatic dependent launch where
    the GPU has them (compute capability 9 and later), never under the interpreter; "off"
    never; the config's value reaches the engine."""
    from dsv4_idxk_probe.config import parse_config

    buffers = [b.to(DEVICE) for b in random_buffers(LAYOUT, 1, 2, seed=6)]
    config = parse_config({"digest": {"dependent_launch": setting}})
    assert DigestEngine.from_config(LAYOUT, [0], buffers, config, role="prefill").dependent_launch == setting
    engine = DigestEngine(LAYOUT, [0], buffers, backend="triton", dependent_launch=setting)
    try:
        capable = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9
        assert engine._kernel.pdl == (setting == "auto" and capable)
    finally:
        engine.close()
    with pytest.raises(ValueError, match=re.escape("dependent_launch must be one of ('auto', 'off'), got 'on'")):
        DigestEngine(LAYOUT, [0], buffers, backend="triton", dependent_launch="on")


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("on_device", [True, False])
def test_an_engine_with_a_page_id_stride_reads_token_indices_as_the_pool_does(backend, on_device, random_buffers):
    """`page_id_stride=4`: a page table of token indices, 4 per page (a HiCache copy's); page
    k is entry 4k over 4, floored, as the pool finds its row. Same digests as the page ids
    themselves give an engine without the stride, in one-room and batched submits; a page
    whose first index is negative is never read (out of range), like id -1."""
    stride = 4
    buffers = random_buffers(LAYOUT, 2, 6, seed=7)
    if backend == "triton":
        buffers = [b.to(DEVICE) for b in buffers]
    plain = DigestEngine(LAYOUT, [0, 1], buffers, backend=backend)
    strided = DigestEngine(LAYOUT, [0, 1], buffers, backend=backend, page_id_stride=stride)
    assert strided.page_id_stride == stride
    # pages 5, 1, 3 of whole token groups, then a group whose first index is not page-aligned
    # (floored to page 2), then one whose first index is negative (never read)
    tokens = [5 * stride + i for i in range(stride)] + [1 * stride + i for i in range(stride)]
    tokens += [3 * stride + i for i in range(stride)] + [2 * stride + 1 + i for i in range(stride)] + [-3, 0, 1, 2]
    ids = [5, 1, 3, 2, -1]

    def table(values):
        if on_device and backend == "triton":
            return torch.tensor(values, dtype=torch.int64, device=DEVICE)
        return values

    n_tokens = 4 * 256 + 100
    got_plain, got_strided = [], []
    plain.submit([RoomRequest("r", table(ids), n_tokens)], got_plain.append)
    strided.submit([RoomRequest("r", table(tokens), n_tokens)], got_strided.append)
    plain.submit([RoomRequest("r", table(ids), n_tokens), RoomRequest("s", table(ids[:2]), 300)], got_plain.append)
    strided.submit([RoomRequest("r", table(tokens), n_tokens), RoomRequest("s", table(tokens[: 2 * stride]), 300)],
                   got_strided.append)
    # a trailing group shorter than the stride is a page, as `tokens[::stride]` counts it
    strided.submit_room("t", table(tokens[: 3 * stride - 1]), 3 * 256, got_strided.append, contents_only=True)
    plain.submit_room("t", table(ids[:3]), 3 * 256, got_plain.append, contents_only=True)
    plain.close()
    strided.close()
    assert len(got_plain) == len(got_strided) == 3
    for a, b in zip(got_plain[:2], got_strided[:2]):
        assert a.out_of_range == b.out_of_range and a.out_of_range[0] == 2  # 2 layers x the negative page
        assert a.room_bytes == b.room_bytes
        for x, y in zip(a.contents, b.contents):  # room "r" (content digests: 0 where not read), room "s"
            assert x.shape == y.shape and (x == y).all() and x.any()
    clean_plain, clean_strided = got_plain[1].digests[1], got_strided[1].digests[1]  # room "s": all ids in range
    assert clean_plain.room == clean_strided.room
    assert (clean_plain.pages == clean_strided.pages).all() and (clean_plain.layer_segment == clean_strided.layer_segment).all()
    (contents_plain,), (contents_strided,) = got_plain[2].contents, got_strided[2].contents
    assert contents_plain.shape == contents_strided.shape == (2, 3, len(LAYOUT.segments))
    assert (contents_plain == contents_strided).all() and contents_plain.any()


@pytest.mark.parametrize("stride", [0, -2, 1.5])
def test_a_page_id_stride_below_one_is_refused(stride, random_buffers):
    with pytest.raises(ValueError, match="page_id_stride"):
        DigestEngine(LAYOUT, [0], random_buffers(LAYOUT, 1, 2, seed=1), backend="reference", page_id_stride=stride)


def test_a_dropped_batchs_staging_buffer_is_held_from_the_allocator(engine, monkeypatch):
    """A dropped batch's kernel may still write its staging buffer (its event failed): the
    buffer is not freed when the batch's last other reference goes (freed, the allocator
    would hand it to SGLang's next tensor)."""
    settled = threading.Event()
    engine.submit([RoomRequest("first", [0], 256)], lambda batch: settled.set())  # behind the warm-up batch
    assert settled.wait(30)
    monkeypatch.setattr(engine, "_finish", lambda ticket: 1 / 0)
    stagings, drop = [], engine._drop

    def watched(ticket, error):
        stagings.append(weakref.ref(ticket.staging) if ticket.staging is not None else None)
        return drop(ticket, error)

    monkeypatch.setattr(engine, "_drop", watched)
    for room in range(3):
        done = threading.Event()
        engine.submit([RoomRequest(f"r{room}", [room % 2], 256)], lambda batch: done.set())
        assert done.wait(10)
    assert engine.stats.dropped_batches == 3
    if stagings[0] is None:
        assert engine.backend == "reference", "a device batch with no staging buffer"
        return
    gc.collect()
    assert all(ref() is not None for ref in stagings), "a dropped batch's staging buffer was freed"


def test_a_buffer_that_does_not_start_on_a_word_boundary_is_refused():
    """The kernel reads whole 4-byte words from each buffer's distance to the layer table: a
    buffer 2 bytes past a word boundary was read from 2 bytes before its start (every cell a
    mismatch, and bytes outside it read). Refused at registration, and by the layer table."""
    from dsv4_idxk_probe.digest.kernel import layer_table

    layout = get_layout("fp4")
    big = torch.zeros(3 * layout.row_bytes + 16, dtype=torch.uint8)
    shifted = big[2 : 2 + 3 * layout.row_bytes].view(3, layout.row_bytes)
    with pytest.raises(ValueError, match="4-byte boundary"):
        DigestEngine(layout, [0], [shifted], backend="reference")
    with pytest.raises(ValueError, match="4-byte words"):
        layer_table([big[: 3 * layout.row_bytes].view(3, -1), shifted], [0, 1], "cpu")
