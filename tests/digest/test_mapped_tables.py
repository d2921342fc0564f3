"""A launch's room table read in place (digest/launch.py): the kernel reads the table, and
page ids that travel with it, from the pinned staging buffer through its own address, so
decode's step launch makes no copy up; big launches, or memory the driver does not map at
its own address, copy up as before (counted); a staging buffer is never rewritten while a
launch that reads it may still run; digests stay the reference's either way."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, get_layout
from dsv4_idxk_probe.digest.pinned import device_maps_host_pointer
from dsv4_idxk_probe.digest.reference import digest_room
from dsv4_idxk_probe.digest.room_table import ROOM_COLUMNS

LAYOUT = get_layout("fp8")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _faked(buffers, collector: bool = False, **options) -> tuple[DigestEngine, list]:
    """An engine on its CUDA submit path, device calls faked (bench/hook_ops.py); the
    several-room launches' kernel arguments are collected in the returned list. Without
    `collector` no collector thread starts: every batch keeps its staging buffer, to be
    read by the test (nothing is delivered)."""
    from bench.hook_ops import fake_device_calls

    engine = fake_device_calls(DigestEngine(LAYOUT, [0, 1], buffers, backend="triton", download="collector",
                                            **options))
    engine._collecting = not collector
    seen: list = []
    engine._direct[0].fn = lambda *call: seen.append(call[7:])  # grid, stream, then the head of 3
    return engine, seen


def _stepped_rooms(engine: DigestEngine) -> list:
    """Two rooms whose page tables an earlier submit found (decode's stepped rooms), one
    whose page ids travel with the table."""
    tables = [torch.tensor([3, 1, 4], dtype=torch.int64), torch.tensor([2, 5], dtype=torch.int32)]
    found = [engine.submit_room(f"r{i}", t, 600, lambda _: None).table for i, t in enumerate(tables)]
    return tables, [SimpleNamespace(key="r0", pages=tables[0], n_tokens=600, table=found[0]),
                    SimpleNamespace(key="r1", pages=tables[1], n_tokens=500, table=found[1]),
                    SimpleNamespace(key="host", pages=[6, 0], n_tokens=300, table=None)]


def test_a_step_launch_reads_its_room_table_in_place_and_copies_nothing_up(random_buffers):
    """The kernel's room-table argument is the pinned buffer's own address, the table and
    the host room's page ids are there, the twin's front holds nothing (no copy up), and
    no launch is counted as having copied its tables."""
    engine, seen = _faked(random_buffers(LAYOUT, 2, 8, seed=1))
    tables, rooms = _stepped_rooms(engine)
    ticket = engine.submit(rooms, lambda _: None)
    staging = ticket.staging
    host_words = staging.words
    assert seen[-1][0] == staging.host_address != staging.device_address
    row = host_words[: 3 * ROOM_COLUMNS].reshape(3, ROOM_COLUMNS)
    assert list(row[0]) == [tables[0].data_ptr(), 8, 3, 600, 0]
    assert list(row[1]) == [tables[1].data_ptr(), 4, 2, 500, 2 * 3]
    at = (int(row[2, 0]) - staging.host_address) // 8  # the host room's ids: in the same pinned buffer
    assert list(row[2, 1:]) == [8, 2, 300, 2 * 5] and list(host_words[at : at + 2]) == [6, 0]
    assert not staging.device[: 8 * (at + 2)].any()  # nothing copied up
    assert engine.stats.copied_tables == 0


@pytest.mark.parametrize("why", ["too many programs", "unmapped", "off"])
def test_a_launch_that_cannot_read_in_place_copies_its_tables_up_and_counts_it(why, random_buffers):
    options = {"mapped_tables": False} if why == "off" else {}
    engine, seen = _faked(random_buffers(LAYOUT, 2, 8, seed=2), **options)
    tables, rooms = _stepped_rooms(engine)
    if why == "too many programs":
        engine._mapped_table_programs = 3 * 2 * 3 - 1  # rooms x layers x pages of the longest: one too many
    elif why == "unmapped":  # a buffer the driver does not map at its own address: every later launch copies
        engine._staging._mapped_check = lambda address: False
        engine._staging.take(1 << 20).host.zero_()  # a size class not reserved: allocated, checked
    ticket = engine.submit(rooms, lambda _: None)
    staging = ticket.staging
    assert seen[-1][0] == staging.device_address
    front = 8 * (3 * ROOM_COLUMNS + 2)
    assert torch.equal(staging.device[:front], staging.host[:front])  # the table and the host ids, copied up
    assert int(staging.words[2 * ROOM_COLUMNS]) == staging.device_address + 8 * 3 * ROOM_COLUMNS
    assert engine.stats.copied_tables == 1


def test_a_staging_buffer_is_not_taken_again_before_its_launch_has_completed(random_buffers):
    """While a batch's event has not completed, the buffer its kernel reads its table from
    stays out of the pool: later submits write their tables elsewhere, and the first
    table's words are unchanged; once the event completes, the buffer comes back."""
    engine, _ = _faked(random_buffers(LAYOUT, 2, 8, seed=3), collector=True)
    tables, rooms = _stepped_rooms(engine)
    release = threading.Event()

    class SlowEvent:  # the kernel still running until `release`
        def record(self, stream=None):
            pass

        def query(self):
            return release.is_set()

        def synchronize(self):
            release.wait(30)

    _wait_for(lambda: engine.stats.completed_rooms == 2)  # the receipts: their events back in the pool
    time.sleep(0.05)
    slow = SlowEvent()
    engine._events._free[:] = [slow]
    first = engine.submit(rooms, lambda _: None)
    assert first.done is slow
    staging, before = first.staging, first.staging.words[: 3 * ROOM_COLUMNS + 2].copy()
    later = [engine.submit(list(reversed(rooms)), lambda _: None) for _ in range(40)]  # more than reserved
    assert all(ticket.staging is not staging for ticket in later)
    assert np.array_equal(staging.words[: 3 * ROOM_COLUMNS + 2], before)
    time.sleep(0.05)
    assert engine.stats.completed_rooms == 2  # nothing after the slow batch
    release.set()
    engine.close()
    assert engine.stats.completed_rooms == 2 + 41 * 3
    assert any(free is staging for free in engine._staging.min_free)


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)


@pytest.mark.parametrize("mapped", [True, False])
def test_digests_are_the_references_read_in_place_or_copied_up(mapped, random_buffers):
    buffers = [b.to(DEVICE) for b in random_buffers(LAYOUT, 2, 9, seed=4)]
    engine = DigestEngine(LAYOUT, [0, 3], buffers, backend="triton", download="collector", contents=True,
                          mapped_tables=mapped)
    copied_at_start = engine.stats.copied_tables  # the start-up batches' (on a GPU)
    host = [b.cpu() for b in buffers]
    rooms = [RoomRequest("list", [4, 2, 8], 2 * 256 + 9),
             RoomRequest("device", torch.tensor([1, 5], dtype=torch.int32, device=DEVICE), 300),
             RoomRequest("numpy", np.array([6, 3, 0, 7]), 4 * 256)]
    got, done = [], threading.Event()
    engine.submit(rooms, lambda b: (got.append(b), done.set()))
    one = engine.submit_room("one", [3, 4, 5], 3 * 256 - 7, got.append)  # one room, ids on the host
    assert done.wait(60)
    one.wait()
    engine.close()
    for room, digest in zip(rooms, got[0].digests):
        pages = room.pages.cpu().numpy() if isinstance(room.pages, torch.Tensor) else room.pages
        assert digest.room == digest_room(host, pages, room.n_tokens, LAYOUT, [0, 3], key=room.key).room
    assert [int(v) for v in one.room_digests] == [digest_room(host, [3, 4, 5], 3 * 256 - 7, LAYOUT, [0, 3]).room]
    # the batch and the one room's host ids
    assert engine.stats.copied_tables - copied_at_start == (0 if mapped else 2)


def test_pageable_memory_is_not_taken_for_memory_a_kernel_reads_in_place():
    """The driver maps pinned memory at its own address; ordinary memory (or no driver at
    all) is never taken for it, and the check does not raise."""
    pageable = np.zeros(64, dtype=np.int64)
    assert device_maps_host_pointer(pageable.ctypes.data) is False
    if torch.cuda.is_available():
        pinned = torch.empty(64, dtype=torch.uint8, pin_memory=True)
        assert device_maps_host_pointer(pinned.data_ptr()) is True


def test_a_class_a_submit_found_empty_is_topped_up_by_the_collector_not_the_serving_thread(random_buffers):
    """A batch larger than the reserved class makes the serving thread allocate once; the
    collector then allocates spares of that class, so the next such batches find a free
    buffer and the serving thread allocates nothing. (Before, every batch of a class that
    ran dry allocated pinned and device memory on the serving thread.)"""
    engine, _ = _faked(random_buffers(LAYOUT, 2, 8, seed=5), collector=True)
    allocated_by = []
    allocate = engine._staging._allocate

    def counted(size):
        allocated_by.append((threading.current_thread() is threading.main_thread(), size))
        return allocate(size)

    engine._staging._allocate = counted
    big = [RoomRequest(f"r{i}", list(range(8)) * 200, 8 * 200 * 256) for i in range(2)]  # 1600 pages each
    engine.submit(big, lambda _: None)
    (serving, size), = allocated_by
    assert serving and size > 128 * 1024
    _wait_for(lambda: len(allocated_by) > 1)
    time.sleep(0.05)
    assert allocated_by[1:] and all(not serving and s == size for serving, s in allocated_by[1:])
    before = len(allocated_by)
    for _ in range(3):
        engine.submit(big, lambda _: None)
    engine.close()
    assert len(allocated_by) == before and not engine._staging.short


@pytest.mark.parametrize("spare", [0, 2])
def test_a_refill_allocates_the_spares_of_each_class_found_empty_and_none_when_off(spare):
    from dsv4_idxk_probe.digest.pinned import StagingPool

    pool = StagingPool(torch.device("cpu"), spare=spare)
    taken = pool.take(300 * 1024)  # the 512 KiB class: none reserved
    pool.refill()
    free = pool._free.get(taken.nbytes, [])
    assert len(free) == spare and all(b.nbytes == taken.nbytes and b is not taken for b in free)
    assert not pool.short and pool.allocations == 1 + spare
