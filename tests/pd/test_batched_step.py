"""A decode step is one launch for all its rooms, built without Python code per room.

Every room stepped in a scheduler step (`DecodeMonitor.batch_done`) is digested by one
kernel launch whose room table the engine builds by C calls over the batch, from each
room's page table as its receipt found it on the device (digest/launch.py,
`_known_tables`); the batch's jobs are made on the collector. Each room's digest is the
one a launch of its own gives."""

from __future__ import annotations

import torch
from tests.support.recordsink import Sink

from bench.harness import CallCounter
from dsv4_idxk_probe.digest import DigestEngine, get_layout
from dsv4_idxk_probe.digest.reference import digest_room
from dsv4_idxk_probe.pd import DecodeMonitor, RoomId

LAYOUT = get_layout("fp8")
LAYER_IDS = [0, 3]


def _buffers(pages: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (pages, LAYOUT.row_bytes), dtype=torch.uint8, generator=g) for _ in LAYER_IDS]


def _tables(n_rooms: int) -> list[torch.Tensor]:
    """Page tables as the kernel's device holds them (here the CPU): read in place."""
    return [torch.tensor([(3 * i + k) % 23 + 1 for k in range(1 + i % 3)], dtype=torch.int64) for i in range(n_rooms)]


def test_rooms_stepped_together_are_one_launch_with_each_rooms_own_digest():
    buffers = _buffers(24, seed=5)
    engine = DigestEngine(LAYOUT, LAYER_IDS, buffers, backend="triton")  # the Triton interpreter without a GPU
    sink = Sink()
    monitor = DecodeMonitor(engine, sink, step_interval=4)
    tables = _tables(5)
    tokens = [256 * len(t) - 37 * i for i, t in enumerate(tables)]
    rooms = [RoomId(100 + i) for i in range(5)]
    for room, pages, n_tokens in zip(rooms, tables, tokens):
        monitor.room_received(room, pages, n_tokens, None)
    receipts = sink.wait_for(5, stage="decode_recv")
    launches = []
    kernel_launch = engine._kernel.launch
    engine._kernel.launch = lambda *a, **k: launches.append(a[4]) or kernel_launch(*a, **k)  # rooms per launch
    monitor.room_skipped(rooms[1], "retracted", stage="decode_step")  # retired: left out of the step
    monitor.batch_done([rooms[4]], [(room, 8 + i) for i, room in enumerate(rooms[:4])])
    finish = sink.wait_for(1, stage="decode_finish")[0]
    steps = sink.wait_for(3, stage="decode_step", verdict="unverified")
    assert launches == [4]  # rooms 0, 2, 3 stepped and room 4 finished: one launch of four rooms
    assert [(r["room"], r["step"]) for r in steps] == [("100", 8), ("102", 10), ("103", 11)]
    by_room = {r["room"]: r["digest"]["room"] for r in receipts}
    for record in [*steps, finish]:
        i = int(record["room"]) - 100
        own = digest_room(buffers, tables[i].numpy(), tokens[i], LAYOUT, LAYER_IDS).room
        assert record["digest"]["room"] == by_room[record["room"]] == f"{own:016x}"
    engine.close()


def test_a_further_room_in_a_step_costs_the_serving_thread_no_call_and_few_bytecodes():
    """Counted on the serving thread (device calls faked as bench/hook_ops.py fakes them):
    16 rooms in a step instead of 2 enter no further Python function, and each further
    room costs at most 3 C calls (its look-up, its table row, its ticket) and 60 bytecodes
    (the look-up, copying the row its receipt found, the ticket). Before, each room cost
    4 C calls and 85 bytecodes: a second look-up of its page table and its job tuple made
    on the serving thread."""
    from bench.hook_ops import cuda_path_engine

    engine = cuda_path_engine(2, 6, contents=False, download="collector")
    monitor = DecodeMonitor(engine, lambda record: None)
    tables = [torch.tensor([1 + i % 5, 2, 3], dtype=torch.int64) for i in range(16)]
    rooms = [RoomId(i) for i in range(16)]
    for room, pages in zip(rooms, tables):
        monitor.room_received(room, pages, 700, None)
    counter, counts = CallCounter(), {}
    for n in (2, 16, 2):  # 2 again: the first count may include a first time's work
        stepped = [(room, 8) for room in rooms[:n]]
        counts[n] = counter.count(lambda: lambda: monitor.batch_done((), stepped))
    engine.close()
    assert counts[16]["python_calls"] == counts[2]["python_calls"]
    assert counts[16]["c_calls"] - counts[2]["c_calls"] <= 3 * 14
    assert 0 < counts[16]["opcodes"] - counts[2]["opcodes"] <= 60 * 14


def test_a_step_makes_the_device_calls_a_one_room_hook_makes_the_launch_and_its_event(monkeypatch):
    """Counted on the serving thread (device calls faked as bench/hook_ops.py fakes them,
    tensor copies counted): a step of 8 rooms launches once and records its event, and
    copies nothing (decode's outputs go down on the collector); its kernel reads the room
    table from the pinned staging buffer itself. Before, the table was copied up first:
    one device call more than a receipt's."""
    from bench.hook_ops import cuda_path_engine

    engine = cuda_path_engine(2, 6, contents=False, download="collector")
    engine._collecting = True  # no collector: the batch keeps its staging buffer while it is read here
    monitor = DecodeMonitor(engine, lambda record: None)
    rooms = [RoomId(i) for i in range(8)]
    for i, room in enumerate(rooms):
        monitor.room_received(room, torch.tensor([1 + i % 5, 2, 3], dtype=torch.int64), 700, None)
    calls: dict = {"launch": [], "event": 0, "copy": 0}
    engine._direct[0].fn = lambda *call: calls["launch"].append(call)
    record = engine._record

    def counted_record(event, stream):
        calls["event"] += 1
        return record(event, stream)

    def counted_copy(self, *args, **kwargs):
        calls["copy"] += 1
        return copy(self, *args, **kwargs)

    copy = torch.Tensor.copy_
    engine._record = counted_record
    monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)
    ticket = monitor.batch_done((), [(room, 8) for room in rooms])
    monkeypatch.undo()
    table_address = calls["launch"][0][7]  # after the grid, the stream and the launch's constant head
    assert (len(calls["launch"]), calls["event"], calls["copy"]) == (1, 1, 0)
    assert table_address == ticket.staging.host_address
    assert engine.stats.copied_tables == 0
