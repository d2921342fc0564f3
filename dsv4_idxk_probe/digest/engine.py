"""Digest rooms of one index-K pool without stalling the caller.

`DigestEngine.submit` writes a small room table into a pinned staging
buffer, copies it up to the buffer's device twin (unless the kernel needs
none of it: a one-room launch with its page table on the device), launches
the Triton kernel on the caller's current stream, copies its cells (and,
for diagnosis, their content digests) down, and records a CUDA event right
behind: three or four device calls, whatever the batch (`OUTPUTS`). A
background thread waits for the event (`WAITS`), folds the cells into room
digests and hands them to the callback. The caller's thread never calls ``.item()``, ``.cpu()``,
``.tolist()`` or a synchronise on this path.

Why the event is recorded on the caller's thread, although that is one more
call there: recorded later, by the collector, it lands behind whatever the
caller enqueued meanwhile, typically the next forward, so the collector wakes
when that forward ends, the very moment the serving thread wakes to take
its results, and both want the GIL (docs/overhead.md). Recorded at once, it
completes a few microseconds after the kernel, and the collector does its
Python work while the serving thread waits for its forward.

Without CUDA the same API digests with the NumPy reference (or with the
Triton kernel under ``TRITON_INTERPRET=1``), at submit time so the snapshot
is the same, and still delivers results on the background thread.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from ..background import HandOff, yield_to_serving
from ..safety import record_error
from . import reference
from .layout import RowLayout, layout_signature
from .pinned import EventPool, Staging, StagingPool
from .result import RoomDigest
from .room_table import ROOM_COLUMNS, CellPlan, RoomRequest, frozen_slots_per_page, plan_cells

log = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "reference")
# How the collector waits for a batch's event. "block": one synchronise on a
# blocking-sync event, the thread asleep in the driver with the GIL released,
# woken once when the kernel is done. "poll": query it, sleeping between
# (`poll_intervals`); each wake-up takes the GIL and makes a driver call.
WAITS = ("block", "poll")
# Where the kernel reads its tables and stores its outputs. "device": the staging
# buffer's device twin, one copy up (when it reads a table) and one down per batch;
# "pinned": the pinned host buffer itself, no copies, but each row's outputs cross
# PCIe as small writes (a 43 x 1024-page fp8 room: 280 us of GPU against 113-124 us;
# 64 pages: 24 against 19 us; bf16 rows gain nothing; bench/RESULTS.md 2026-12-02).
OUTPUTS = ("device", "pinned")
# How the kernel is launched. "auto": a programmatic dependent launch where the GPU
# has them (compute capability 9 and later), a plain one elsewhere; "off": plain.
DEPENDENT_LAUNCHES = ("auto", "off")


@dataclass
class BatchResult:
    """What one submit produced, handed to its callback on the collector thread."""

    digests: list[RoomDigest]
    rows: int
    bytes_digested: int
    gpu_seconds: float | None = None  # kernel time, when measured on a GPU
    room_bytes: tuple[int, ...] = ()  # frozen bytes digested per room, in submit order
    error: str | None = None  # the batch could not be digested (no digests): why
    # Per room, in submit order: its (layer, page) rows whose physical page id lay outside
    # that layer's buffer, so they were not read. A room with any has a digest that
    # compares equal to none (docs/digest.md, "Page ids out of range").
    out_of_range: tuple[int, ...] = ()
    # Per room, in submit order: each cell's content digest, uint64 [layers, pages,
    # segments] (the segment digest d of docs/digest.md, "Content digests"; 0 where a
    # row was not read), computed in the same kernel pass as the digests. A copy the
    # callback may keep.
    contents: tuple[np.ndarray, ...] = ()


@dataclass
class EngineStats:
    submitted_rooms: int = 0
    completed_rooms: int = 0
    dropped_batches: int = 0
    callback_errors: int = 0
    out_of_range_rooms: int = 0  # rooms with a page id outside a registered buffer
    out_of_range_rows: int = 0  # their (layer, page) rows, never read


@dataclass
class PendingDigest:
    """A submitted batch. `room_digests` is readable once `ready()`, or once the
    submitting stream has been synchronised by someone else (SGLang's NIXL path
    blocks on it before sending, which is how the in-band slot is filled)."""

    plan: CellPlan
    rooms: list[RoomRequest]
    callback: Callable[[BatchResult], None]
    cells: np.ndarray  # uint64 [n_cells, n_segments], filled by the kernel (or the reference)
    done: Any = None  # CUDA event; None when the cells are already on the host
    started: Any = None  # CUDA timing event
    staging: Staging | None = None  # to give back once done
    keepalive: list = field(default_factory=list)  # device inputs that must outlive the kernel
    final_rooms: np.ndarray | None = None  # a private copy, once collected
    counted: bool = True  # False for the engine's own warm-up batch
    error: str | None = None  # recording `done` failed: the collector drops the batch
    flags: np.ndarray | None = None  # uint8 [n_cells]: 1 where the row's page id was out of range
    contents: np.ndarray | None = None  # uint64 [n_cells, n_segments]: each cell's content digest
    contents_only: bool = False  # the caller wants the contents alone: no fold, no digests (see `submit`)

    def ready(self) -> bool:
        """Whether `room_digests` is readable now; never, for a batch whose event failed."""
        if self.error is not None:
            return False
        done = self.done  # read once: the collector clears it when it recycles the event
        return done is None or done.query()

    def wait(self) -> bool:
        """Block until `room_digests` is readable: a host sync, for enforce mode only.
        False, at once, for a batch whose event failed: its digests never will be."""
        if self.error is not None:
            return False
        done = self.done
        if done is not None:
            done.synchronize()  # if recycled meanwhile, this waits for a later batch: longer, still right
        return True

    @property
    def room_digests(self) -> np.ndarray:
        """uint64 [n_rooms], in submit order: the sum mod 2^64 of each room's cells; a
        fresh random value for a room with out-of-range page ids (it must match nothing)."""
        if self.final_rooms is not None:
            return self.final_rooms
        return np.array([self.plan.block(self.cells, i).sum(dtype=np.uint64) if not n else secrets.randbits(64)
                         for i, n in enumerate(out_of_range_counts(self.plan, self.flags))], dtype=np.uint64)


def out_of_range_counts(plan: CellPlan, flags: np.ndarray | None) -> list[int]:
    """Per room: its (layer, page) rows flagged as out of range."""
    if flags is None or not flags.any():  # nearly every batch: one pass over a byte per row
        return [0] * len(plan.page_counts)
    return [int(flag_block(plan, flags, i).sum()) for i in range(len(plan.page_counts))]


def poll_intervals(first: float, most: float) -> Iterator[float]:
    """Sleeps between polls of one batch's event: doubling from `first` up to `most`.

    Each poll takes the GIL and makes a driver call. An event recorded behind
    a forward completes only when that forward does (tens of ms), and a fixed
    0.5 ms poll would wake the collector dozens of times per batch, each time
    taking the GIL from the serving thread; doubling keeps it to a few.
    """
    wait = first
    while True:
        yield wait
        wait = min(most, 2 * wait)


class DigestEngine:
    """Digests rooms of one pool: `buffers[i]` is layer `layer_ids[i]`, uint8 [pages, row_bytes].

    `contents`: whether results carry each cell's content digest (what the
    diagnosis needs); without, its copy down and its copy out are spared.
    `outputs`: where the kernel reads and stores (`OUTPUTS`).
    `dependent_launch` (`DEPENDENT_LAUNCHES`): "auto" launches the kernel as a
    programmatic dependent launch where the GPU has them (compute capability 9
    and later): it starts as the kernel before it drains instead of after it
    (fp4 rooms read 2% faster back to back, bench/RESULTS.md 2026-12-02 06:34
    UTC) and reads the same bytes; "off": plain launches."""

    def __init__(
        self,
        layout: RowLayout,
        layer_ids: Sequence[int],
        buffers: Sequence[torch.Tensor],
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
        block: int | None = None,
        rows: int | None = None,
        num_warps: int | None = None,
        max_pending: int = 1024,
        poll_interval_s: float = 0.0005,
        max_poll_interval_s: float = 0.004,
        wait: str = "block",
        time_kernels: bool = False,
        prealloc: int = 32,
        contents: bool = True,
        outputs: str = "device",
        dependent_launch: str = "auto",
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if wait not in WAITS:
            raise ValueError(f"wait must be one of {WAITS}, got {wait!r}")
        if outputs not in OUTPUTS:
            raise ValueError(f"outputs must be one of {OUTPUTS}, got {outputs!r}")
        if dependent_launch not in DEPENDENT_LAUNCHES:
            raise ValueError(f"dependent_launch must be one of {DEPENDENT_LAUNCHES}, got {dependent_launch!r}")
        if len(buffers) != len(layer_ids):
            raise ValueError(f"{len(buffers)} buffers for {len(layer_ids)} layer ids")
        for i, buf in enumerate(buffers):
            if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != layout.row_bytes:
                raise ValueError(
                    f"buffer {i} (layer {layer_ids[i]}) is {buf.dtype} {tuple(buf.shape)}, "
                    f"layout {layout.name!r} needs uint8 [pages, {layout.row_bytes}]"
                )
            if not buf.is_contiguous():
                raise ValueError(f"buffer {i} (layer {layer_ids[i]}) is not contiguous")
        self.layout = layout
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.signature = layout_signature(layout, self.layer_ids)
        self.buffers = list(buffers)
        self.device = torch.device(device) if device is not None else (buffers[0].device if buffers else torch.device("cpu"))
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "reference"
        self.backend = backend
        # `block` is no longer used: the kernel reads each segment of a row as one tile
        # (issue 21). Rows per program and warps: the fastest on an H200 (bench/RESULTS.md).
        self.block = block
        shape = kernel_shape(layout)
        self.rows = rows or shape["rows"]
        self.num_warps = num_warps or shape["num_warps"]
        self.outputs = outputs
        self.dependent_launch = dependent_launch
        self._copies = outputs == "device"  # the kernel reads and stores the twin, copied up and down
        self._staging = StagingPool(self.device, twin=self._copies)
        self.wait = wait
        self._events = EventPool(blocking=wait == "block")
        if self.backend == "triton" and self.device.type == "cuda":
            # Pinned allocation costs milliseconds: reserve now, not on the hot path,
            # for bursts of batches up to the smallest size class (64 KiB), and of
            # single-room batches up to 64 pages where those need more.
            self._staging.reserve(staging_bytes(32 + 64, len(self.layer_ids) * 64, len(layout.segments)), prealloc)
        self.poll_interval_s = poll_interval_s
        self.max_poll_interval_s = max(poll_interval_s, max_poll_interval_s)
        self.time_kernels = time_kernels and self.device.type == "cuda"
        self.contents = contents
        self.stats = EngineStats()
        self._frozen_bytes_per_slot = sum(s.slot_bytes for s in layout.segments)
        # Batches waiting for the collector; more are dropped before their launch (one or
        # two more may get in when several threads submit at once).
        self.max_pending = max_pending
        self._tickets = HandOff()
        self._thread: threading.Thread | None = None
        self._collecting = False  # the collector thread runs: one attribute read per submit
        self._warm_up_queued = False  # the start-up batch waits in the queue: it takes no caller's place
        self._lock = threading.Lock()
        self._streams: dict[int, Any] = {}  # raw stream handle -> its torch stream
        if self.backend == "triton":
            from .kernel import DigestKernel, current_stream, dependent_launches_on, layer_table  # Triton: only here

            self._current_stream = current_stream
            # Each layer's buffer, global id and page count; the kernel reads it on the device.
            self._layer_table, base_align = layer_table(self.buffers, self.layer_ids, self.device)
            self._kernel = DigestKernel(
                self._layer_table, len(self.layer_ids), layout, rows=self.rows, num_warps=self.num_warps,
                base_align=base_align, contents=contents,
                pdl=dependent_launch == "auto" and dependent_launches_on(self.device),
            )
            if self.device.type == "cuda":
                self._warm_up()

    @classmethod
    def from_config(cls, layout: RowLayout, layer_ids: Sequence[int], buffers: Sequence[torch.Tensor], config: Any, *,
                    role: str) -> "DigestEngine":
        """An engine set up by the probe config (its `digest` section), for `role`'s side:
        content digests only on decode with diagnosis on, the one reader of them."""
        return cls(layout, layer_ids, buffers, wait=config.digest.collector_wait, outputs=config.digest.outputs,
                   dependent_launch=config.digest.dependent_launch,
                   contents=role == "decode" and config.diagnosis.enabled)

    # %% public API

    def submit(self, rooms: Sequence[RoomRequest], callback: Callable[[BatchResult], None], *,
               contents_only: bool = False) -> PendingDigest | None:
        """Digest `rooms` in one launch; `callback` runs later on the collector thread.

        Returns None (and counts the drop) when too many batches are pending;
        it never waits. `contents_only`: the callback needs the cells' content
        digests alone (a diagnosis snapshot), so the collector skips the fold:
        its result has no digests and no room bytes, and the ticket no room digests.
        """
        # Before the launch: a launched batch is never dropped.
        if len(self._tickets.items) - self._warm_up_queued >= self.max_pending:
            self.stats.dropped_batches += 1
            return None
        ticket = self._launch(list(rooms), callback)
        ticket.contents_only = contents_only
        if not self._collecting:
            self._start_collector()
        self._tickets.put(ticket)
        self.stats.submitted_rooms += len(ticket.rooms)
        return ticket

    def backlog(self) -> int:
        """Batches submitted whose results the collector has not delivered yet."""
        return len(self._tickets.items)

    def digest_now(self, rooms: Sequence[RoomRequest]) -> list[RoomDigest]:
        """Digest and wait: for tests, tools and host memory, never for the scheduler thread."""
        ticket = self._launch(list(rooms), lambda _: None)
        if ticket.done is not None:
            ticket.done.synchronize()
        return self._finish(ticket).digests

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver what is pending, then stop the collector thread."""
        thread = self._thread
        if thread is None:
            return
        self._tickets.put(None)
        thread.join(timeout_s)
        self._thread = None

    # %% launch

    def _launch(self, rooms: list[RoomRequest], callback) -> PendingDigest:
        plan = plan_cells(rooms, len(self.layer_ids))
        if self.backend == "reference":
            cells, contents, flags = self._reference_cells(plan, rooms)
            return PendingDigest(plan, rooms, callback, cells, flags=flags, contents=contents if self.contents else None)
        return self._launch_triton(plan, rooms, callback)

    def _reference_cells(self, plan: CellPlan, rooms: list[RoomRequest]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The cells, contents and out-of-range flags the kernel stores, computed with the reference."""
        cells = np.zeros((plan.n_cells, len(self.layout.segments)), dtype=np.uint64)
        contents = np.zeros_like(cells)
        flags = np.zeros(plan.n_cells, dtype=np.uint8)
        for slot, room in enumerate(rooms):
            pages = room.pages.cpu().numpy() if isinstance(room.pages, torch.Tensor) else room.pages
            checked_room_cells(self.buffers, pages, room.n_tokens, self.layout, self.layer_ids,
                               plan.block(cells, slot), flag_block(plan, flags, slot), plan.block(contents, slot))
        return cells, contents, flags

    def _device_pages(self, pages: Any) -> torch.Tensor | None:
        """The room's page table where it already lives on the kernel's device, read in
        place (int32 or int64); None when it must travel in the staging buffer."""
        if not isinstance(pages, torch.Tensor) or pages.device != self.device:
            return None
        if pages.dtype not in (torch.int32, torch.int64) or not pages.is_contiguous():
            pages = pages.to(dtype=torch.int64).contiguous()  # one more device op, for odd callers only
        return pages

    def _launch_triton(self, plan: CellPlan, rooms: list[RoomRequest], callback) -> PendingDigest:
        """Three or four device calls per batch, whatever its size: the tables' copy up
        (when the kernel reads any), the launch, the outputs' copy down, and the batch's
        event right behind them (why here: the module's docstring). The kernel reads the
        room table (and the page tables that live on the host) from the staging buffer's
        device twin and stores cells, flags and contents into the back of it. With
        `outputs="pinned"`: two calls, the kernel reading and storing the pinned buffer."""
        n_rooms, n_segments = len(rooms), len(self.layout.segments)
        on_device, host_words = [], 0  # per room: its page table where the kernel reads it in place, else None
        for slot, room in enumerate(rooms):
            dev = self._device_pages(room.pages) if isinstance(room.pages, torch.Tensor) else None
            on_device.append(dev)
            host_words += plan.page_counts[slot] if dev is None else 0
        table_words = ROOM_COLUMNS * n_rooms
        input_words = -(-(table_words + host_words) // 32) * 32  # cells 256-byte aligned
        staging = self._staging.take(staging_bytes(input_words, plan.n_cells, n_segments))
        copies = self._copies  # else the kernel reads and stores the pinned buffer
        words, read_base = staging.words, staging.device_address if copies else staging.host_address

        # One NumPy write per page table and per table row: each call counts on a
        # serving thread that comes back to the probe after a model step.
        cursor = table_words
        for slot, (room, dev) in enumerate(zip(rooms, on_device)):
            if dev is not None:
                address, id_bytes = dev.data_ptr(), dev.element_size()
            else:
                pages, n_pages = room.pages, plan.page_counts[slot]
                words[cursor : cursor + n_pages] = pages.cpu() if isinstance(pages, torch.Tensor) else pages
                address, id_bytes = read_base + 8 * cursor, 8
                cursor += n_pages
            row = ROOM_COLUMNS * slot
            words[row : row + ROOM_COLUMNS] = (address, id_bytes, plan.page_counts[slot], room.n_tokens, plan.first_cells[slot])
        # One room: its fields go to the kernel by value too (it then never reads the table).
        one_room = (address, id_bytes, plan.page_counts[0], rooms[0].n_tokens) if n_rooms == 1 else None
        # Cells, then a flag byte per row (padded to a word), then contents: without
        # diagnosis the copy down stops before the contents, half the bytes.
        cells_end = input_words + plan.n_cells * n_segments
        contents_start = cells_end + -(-plan.n_cells // 8)
        contents_end = contents_start + plan.n_cells * n_segments
        cells = words[input_words:cells_end].view(np.uint64).reshape(-1, n_segments)
        flags = staging.host.numpy()[8 * cells_end : 8 * cells_end + plan.n_cells]
        contents = words[contents_start:contents_end].view(np.uint64).reshape(-1, n_segments) if self.contents else None
        download_end = 8 * contents_end if self.contents else 8 * cells_end + plan.n_cells
        cells_address, flags_address = read_base + 8 * input_words, read_base + 8 * cells_end
        contents_address = read_base + 8 * contents_start

        started = None
        if self.time_kernels:
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        keepalive = [d for d in on_device if d is not None]
        if copies and (one_room is None or cursor > table_words):  # the kernel reads a table or host page ids
            staging.upload(8 * cursor)
        on_cuda = self.device.type == "cuda"  # else the interpreter runs the kernel now, on no stream
        device, raw_stream = self._current_stream() if on_cuda else (None, None)
        self._kernel.launch(read_base, cells_address, contents_address, flags_address, n_rooms, plan.max_pages,
                            one_room=one_room, device=device, stream=raw_stream)
        if copies:
            staging.download(8 * input_words, download_end)
        if not on_cuda:
            return PendingDigest(plan, rooms, callback, cells, staging=staging, keepalive=keepalive, flags=flags,
                                 contents=contents)
        stream = self._streams.get(raw_stream)
        if stream is None:
            stream = self._stream_object(raw_stream)
        done = self._events.take(self.time_kernels)
        ticket = PendingDigest(plan, rooms, callback, cells, done, started, staging, keepalive, flags=flags,
                               contents=contents)
        try:
            done.record(stream)
        except Exception as exc:  # the serving thread goes on; the collector drops the batch
            record_error("digest.record")
            ticket.error = f"{type(exc).__name__}: {exc}"
        return ticket

    def _stream_object(self, raw_stream: int):
        """The torch stream of a raw handle, to record events on: made once per stream
        (a serving thread launches on the same few), not once per batch; looking up
        the current torch stream costs more than the record itself."""
        stream = self._streams[raw_stream] = torch.cuda.current_stream()  # the one `raw_stream` was read from
        return stream

    def _warm_up(self) -> None:
        """Compile (or load) the kernel now, at start-up, not on the first room: a cold
        Triton compile takes about a second. An empty room (no frozen slot), never waited
        for; the collector recycles its buffers like any batch's, and counts no room."""
        rooms = [RoomRequest("warm-up", [0], 0)]
        try:
            ticket = self._launch_triton(plan_cells(rooms, len(self.layer_ids)), rooms, lambda _: None)
        except Exception:
            log.exception("digest kernel warm-up failed; the first room will compile it")
            return
        ticket.counted = False
        self._start_collector()
        self._warm_up_queued = True
        self._tickets.put(ticket)

    # %% collection

    def _start_collector(self) -> None:
        """Start the collector thread unless it runs (again, should it ever have died)."""
        with self._lock:
            if not self._collecting:
                self._collecting = True
                self._thread = threading.Thread(target=self._collect, name="dsv4-idxk-digest", daemon=True)
                self._thread.start()

    def _collect(self) -> None:
        try:
            while True:
                ticket = self._tickets.get()
                if ticket is None:
                    return
                if not ticket.counted:
                    self._warm_up_queued = False
                if self._await(ticket):
                    self._deliver(ticket, self._finish)
                if self._tickets.items:
                    yield_to_serving()  # between batches too, when several are waiting
        finally:
            self._collecting = False

    def _await(self, ticket: PendingDigest) -> bool:
        """Wait until the batch's kernel is done. False when a device call failed (the
        event's record at submit, or the wait): the batch is dropped, counted, its
        callback gets a result with `error` set and no digests, and its staging buffer
        is never reused (the GPU may still write it); the collector goes on."""
        if ticket.error is not None:  # counted where it happened
            return self._drop(ticket, ticket.error)
        try:
            done = ticket.done
            if done is None:
                return True
            if self.wait == "block":
                done.synchronize()  # this thread only; the serving thread never waits here
                return True
            waits = poll_intervals(self.poll_interval_s, self.max_poll_interval_s)
            while not done.query():
                time.sleep(next(waits))
            return True
        except Exception as exc:
            record_error("digest.await")
            return self._drop(ticket, f"{type(exc).__name__}: {exc}")

    def _drop(self, ticket: PendingDigest, error: str) -> bool:
        """A batch that cannot be digested: counted, and its callback told why, so the
        caller stops waiting for its rooms."""
        self.stats.dropped_batches += 1
        self._deliver(ticket, lambda _: BatchResult([], 0, 0, error=error))
        return False

    def _deliver(self, ticket: PendingDigest, result: Callable[[PendingDigest], BatchResult]) -> None:
        """Hand the batch's result to its callback; a failing callback (or fold) is
        counted and logged, never allowed to end the collector."""
        try:
            ticket.callback(result(ticket))
        except Exception:
            self.stats.callback_errors += 1
            log.exception("digest callback failed")

    def _release(self, ticket: PendingDigest) -> None:
        """Give a completed batch's staging buffer and event back to their pools."""
        if ticket.staging is not None:
            self._staging.give(ticket.staging)
            ticket.staging = None
        if ticket.done is not None and ticket.started is None:
            self._events.give(ticket.done)  # re-recorded by a later batch: ready() no longer asks it
            ticket.done = None
        ticket.keepalive.clear()

    def _finish(self, ticket: PendingDigest) -> BatchResult:
        """Fold each room's cells (the event has completed), then recycle the buffers."""
        if ticket.contents_only:
            return self._finish_contents(ticket)
        plan, digests, room_bytes = ticket.plan, [], []
        out_of_range = out_of_range_counts(plan, ticket.flags)
        for slot, room in enumerate(ticket.rooms):
            layer_segment, pages = reference.fold_cells(plan.block(ticket.cells, slot))
            digests.append(
                RoomDigest(
                    key=room.key,
                    # Rows not read make the digest worthless: a signature no other digest
                    # has, so every comparison says not_comparable, never match.
                    signature=self.signature if not out_of_range[slot] else secrets.randbits(64),
                    n_tokens=room.n_tokens,
                    layer_ids=self.layer_ids,
                    segments=self.layout.segment_names,
                    layer_segment=layer_segment,
                    pages=pages,
                )
            )
            frozen = min(max(room.n_tokens, 0) // self.layout.tokens_per_slot, room.n_pages * self.layout.slots)
            unread = 0
            if out_of_range[slot]:  # rows not read are not digested bytes
                per_page = frozen_slots_per_page(self.layout, room.n_pages, room.n_tokens)
                unread = int(flag_block(plan, ticket.flags, slot).sum(axis=0, dtype=np.int64) @ per_page)
            room_bytes.append((frozen * len(self.layer_ids) - unread) * self._frozen_bytes_per_slot)
        gpu_seconds = None
        if ticket.started is not None and ticket.done is not None:
            gpu_seconds = ticket.started.elapsed_time(ticket.done) / 1000.0
        ticket.final_rooms = np.array([d.layer_segment.sum(dtype=np.uint64) if not n else secrets.randbits(64)
                                       for d, n in zip(digests, out_of_range)], dtype=np.uint64)
        room_contents = self._hand_back(ticket, out_of_range)
        return BatchResult(digests, plan.n_cells, sum(room_bytes), gpu_seconds, tuple(room_bytes),
                           out_of_range=tuple(out_of_range), contents=room_contents)

    def _finish_contents(self, ticket: PendingDigest) -> BatchResult:
        """A contents-only batch: its contents and out-of-range rows, no fold."""
        out_of_range = out_of_range_counts(ticket.plan, ticket.flags)
        ticket.final_rooms = np.zeros(0, dtype=np.uint64)  # never folded: no room digests to read
        room_contents = self._hand_back(ticket, out_of_range)
        return BatchResult([], ticket.plan.n_cells, 0, out_of_range=tuple(out_of_range), contents=room_contents)

    def _hand_back(self, ticket: PendingDigest, out_of_range: list[int]) -> tuple:
        """What every finished batch does last: count its rooms and out-of-range rows, copy
        its contents out of the staging buffer once, and recycle the buffers. Each room's
        contents, a view of that copy."""
        if ticket.counted:
            self.stats.completed_rooms += len(ticket.rooms)
            if any(out_of_range):
                self._count_out_of_range(ticket.rooms, out_of_range)
        contents = ticket.contents.copy() if ticket.contents is not None else None
        ticket.contents = contents
        self._release(ticket)
        plan = ticket.plan
        return () if contents is None else tuple(plan.block(contents, slot) for slot in range(len(ticket.rooms)))

    def _count_out_of_range(self, rooms: list[RoomRequest], out_of_range: list[int]) -> None:
        """A page id outside a registered buffer is a probe failure (a wrong page table):
        counted in the engine's stats and as a probe error, logged, never read."""
        self.stats.out_of_range_rooms += sum(1 for n in out_of_range if n)
        self.stats.out_of_range_rows += sum(out_of_range)
        keys = [room.key for room, n in zip(rooms, out_of_range) if n]
        try:
            raise PageOutOfRange(f"{sum(out_of_range)} (layer, page) rows of rooms {keys[:8]} have a page id "
                                 f"outside their layer's buffer; not read, not comparable")
        except PageOutOfRange:
            record_error("digest.page_out_of_range")


class PageOutOfRange(ValueError):
    """A room's page table names a page outside a registered buffer."""


def flag_block(plan: CellPlan, flags: np.ndarray, slot: int) -> np.ndarray:
    """Room `slot`'s out-of-range flags as uint8 [layers, pages] (a view)."""
    first, n_pages = plan.first_cells[slot], plan.page_counts[slot]
    return flags[first : first + plan.n_layers * n_pages].reshape(plan.n_layers, n_pages)


def staging_bytes(input_words: int, n_cells: int, n_segments: int) -> int:
    """A batch's staging buffer: its tables, then its cells, then a flag byte per cell row
    (padded to 8 bytes), then the cells' contents."""
    return 8 * (input_words + 2 * n_cells * n_segments + -(-n_cells // 8))


def checked_room_cells(buffers: Sequence, pages, n_tokens: int, layout: RowLayout, layer_ids: Sequence[int],
                       cells: np.ndarray, flags: np.ndarray, contents: np.ndarray | None = None) -> None:
    """`reference.room_cells`, with page ids checked as the kernel checks them: a row whose
    id lies outside its layer's buffer is not read, its cells (and contents) are 0 and its
    flag 1. `cells` (uint64 [layers, pages, segments]), `flags` (uint8 [layers, pages])
    and, when given, `contents` (each cell's content digest, like `cells`) are filled."""
    pages = np.asarray(pages).reshape(-1).astype(np.int64)
    n_pages = len(pages)
    frozen = frozen_slots_per_page(layout, n_pages, n_tokens)
    for li, (buf, layer_id) in enumerate(zip(buffers, layer_ids)):
        readable = (pages >= 0) & (pages < buf.shape[0])
        flags[li] = ~readable
        cells[li] = 0
        if contents is not None:
            contents[li] = 0
        if readable.any():
            rows = reference._as_rows(buf)[pages[readable]]
            logical = np.flatnonzero(readable)
            digests = reference.segment_digests(rows, frozen[readable], layout)
            cells[li, readable] = reference.cell_contributions(digests, [layer_id] * len(logical), logical)
            if contents is not None:
                contents[li, readable] = digests


# Rows per program and warps per program, fastest on an H200
# per layout in the sweep of bench/RESULTS.md (2026-12-01 11:25 UTC, steady timing): one
# row per program, one warp for rows up to 8448 B (no cross-warp reduction, 16 loads of
# 16 B in flight per thread), four for larger rows; the digests are the same whatever they are.
def kernel_shape(layout: RowLayout) -> dict:
    if layout.row_bytes <= 8448:
        return {"rows": 1, "num_warps": 1}
    return {"rows": 1, "num_warps": 4}
