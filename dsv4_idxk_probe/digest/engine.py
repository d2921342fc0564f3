"""Digest rooms of one index-K pool without stalling the caller.

`DigestEngine.submit` builds the work list on the host, launches the Triton
kernel on the caller's current stream, queues a copy of the results into
pinned host memory behind a CUDA event, and returns. A background thread
polls the event (never blocks on it) and hands finished rooms to the
callback. The caller's thread never calls ``.item()``, ``.cpu()``,
``.tolist()`` or a synchronise on this path.

Without CUDA the same API digests with the NumPy reference (or with the
Triton kernel under ``TRITON_INTERPRET=1``), at submit time so the snapshot
is the same, and still delivers results on the background thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from . import reference
from .layout import RowLayout, layout_signature
from .pinned import EventPool, PinnedPool
from .result import RoomDigest
from .worklist import RoomRequest, WorkList, build_worklist

log = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "reference")


@dataclass
class BatchResult:
    """What one submit produced, handed to its callback on the collector thread."""

    digests: list[RoomDigest]
    rows: int
    bytes_digested: int
    gpu_seconds: float | None = None  # kernel time, when measured on a GPU
    room_bytes: tuple[int, ...] = ()  # frozen bytes digested per room, in submit order


@dataclass
class EngineStats:
    submitted_rooms: int = 0
    completed_rooms: int = 0
    dropped_batches: int = 0
    callback_errors: int = 0


@dataclass
class PendingDigest:
    """A submitted batch. `room_digests` is readable once `ready()`, or once the
    submitting stream has been synchronised by someone else (SGLang's NIXL path
    blocks on it before sending, which is how the in-band slot is filled)."""

    worklist: WorkList
    rooms: list[RoomRequest]
    callback: Callable[[BatchResult], None]
    host_out: Any  # np.ndarray, or a pinned int64 tensor being filled
    done: Any = None  # CUDA event; None when the result is already on the host
    started: Any = None  # CUDA timing event
    keepalive: list = field(default_factory=list)  # device inputs that must outlive the kernel
    pinned: list = field(default_factory=list)  # staging buffers to give back once done
    final_rooms: np.ndarray | None = None  # a private copy, once collected
    counted: bool = True  # False for the engine's own warm-up batch

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    @property
    def room_digests(self) -> np.ndarray:
        """uint64 [n_rooms], in submit order: each room's cells folded (a sum mod 2^64 of
        its (layer, segment) block, taken on the host: a few words per room)."""
        if self.final_rooms is not None:
            return self.final_rooms
        out = self.host_out
        out = (out.numpy() if isinstance(out, torch.Tensor) else out).view(np.uint64)
        blocks = out[: len(self.rooms) * self.worklist.ls_size].reshape(len(self.rooms), self.worklist.ls_size)
        return blocks.sum(axis=1, dtype=np.uint64)


class DigestEngine:
    """Digests rooms of one pool: `buffers[i]` is layer `layer_ids[i]`, uint8 [pages, row_bytes]."""

    def __init__(
        self,
        layout: RowLayout,
        layer_ids: Sequence[int],
        buffers: Sequence[torch.Tensor],
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
        block: int | None = None,
        rows: int = 1,
        max_pending: int = 1024,
        poll_interval_s: float = 0.0005,
        time_kernels: bool = False,
        prealloc: int = 64,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
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
        # Fastest on an H200 (bench/RESULTS.md): 128-word steps for rows up to
        # 8448 B, 256 for larger rows, one row per program.
        self.block = block or (128 if layout.row_bytes <= 8448 else 256)
        self.rows = rows
        self._pinned = PinnedPool(pin=self.device.type == "cuda")
        self._events = EventPool()
        if self.backend == "triton" and self.device.type == "cuda":
            # Pinned allocation costs milliseconds: reserve for bursts of
            # single-room batches (up to 64 pages) now rather than on the hot path.
            out_words = len(self.layer_ids) * len(layout.segments) + 64
            self._pinned.reserve(256 + 16 * len(self.layer_ids) * 64 + 256 + 8 * 64 + 256 + 8 * out_words, prealloc)
            self._pinned.reserve(8 * out_words, prealloc)
        self.poll_interval_s = poll_interval_s
        self.time_kernels = time_kernels and self.device.type == "cuda"
        self.stats = EngineStats()
        self._frozen_bytes_per_slot = sum(s.slot_bytes for s in layout.segments)
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        if self.backend == "triton":
            self._layer_table = torch.tensor(
                [[b.data_ptr(), lid] for b, lid in zip(self.buffers, self.layer_ids)], dtype=torch.int64
            ).reshape(-1, 2).to(self.device)
            self._segment_table = torch.tensor(
                [[s.word_offset, s.slot_words] for s in layout.segments], dtype=torch.int32
            ).to(self.device)
            if self.device.type == "cuda":
                self._warm_up()

    # %% public API

    def submit(self, rooms: Sequence[RoomRequest], callback: Callable[[BatchResult], None]) -> PendingDigest | None:
        """Digest `rooms` in one launch; `callback` runs later on the collector thread.

        Returns None (and counts the drop) when too many batches are pending;
        it never waits.
        """
        ticket = self._launch(list(rooms), callback)
        self._ensure_thread()
        try:
            self._queue.put_nowait(ticket)
        except queue.Full:
            self.stats.dropped_batches += 1
            return None
        self.stats.submitted_rooms += len(ticket.rooms)
        return ticket

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
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            log.warning("digest queue still full at close; pending results are dropped")
            return
        thread.join(timeout_s)
        self._thread = None

    # %% launch

    def _launch(self, rooms: list[RoomRequest], callback) -> PendingDigest:
        worklist = build_worklist(self.layout, len(self.layer_ids), rooms)
        if self.backend == "reference":
            return PendingDigest(worklist, rooms, callback, self._reference_out(worklist, rooms))
        return self._launch_triton(worklist, rooms, callback)

    def _reference_out(self, worklist: WorkList, rooms: list[RoomRequest]) -> np.ndarray:
        out = np.zeros(worklist.out_size, dtype=np.uint64)
        for slot, room in enumerate(rooms):
            pages = room.pages.cpu().numpy() if isinstance(room.pages, torch.Tensor) else room.pages
            digest = reference.digest_room(self.buffers, pages, room.n_tokens, self.layout, self.layer_ids)
            ls = worklist.ls_offsets[slot]
            out[ls : ls + digest.layer_segment.size] = digest.layer_segment.reshape(-1)
            po = worklist.page_offsets[slot]
            out[po : po + digest.n_pages] = digest.pages
        return out

    def _device_pages(self, pages: Any) -> torch.Tensor | None:
        """The room's page table where it already lives on the kernel's device (no copy,
        no host read-back); None when it must travel in the staging buffer."""
        if isinstance(pages, torch.Tensor) and pages.device == self.device:
            return pages.to(dtype=torch.int64).contiguous()
        return None

    def _launch_triton(self, worklist: WorkList, rooms: list[RoomRequest], callback) -> PendingDigest:
        """Four device calls per batch, whatever its size: one upload, one launch, one
        download, one event. The upload carries the room table, the work list, the
        page tables that live on the host, and the zeroed output the kernel adds into."""
        from .kernel import launch_digest  # Triton is imported only when the kernel is used

        n_rooms, n_items = len(rooms), len(worklist.work)
        on_device = [self._device_pages(room.pages) for room in rooms]
        host_pages = [
            np.asarray(room.pages.cpu() if isinstance(room.pages, torch.Tensor) else room.pages, dtype=np.int64).reshape(-1)
            for room, dev in zip(rooms, on_device) if dev is None
        ]
        # Regions 256-byte aligned, so Triton sees one pointer alignment and compiles once.
        sizes = (24 * n_rooms, 16 * n_items, 8 * sum(p.size for p in host_pages), 8 * worklist.out_size)
        starts, total = [], 0
        for size in sizes:
            starts.append(total)
            total += -(-size // 256) * 256
        room_at, work_at, pages_at, out_at = starts
        staging = self._pinned.take(total)
        inputs = torch.empty(total, dtype=torch.uint8, device=self.device)
        base = inputs.data_ptr()

        table = staging[room_at : room_at + sizes[0]].view(torch.int64).view(n_rooms, 3).numpy()
        page_words = staging[pages_at : pages_at + sizes[2]].view(torch.int64).numpy()
        addresses, cursor, host_iter = [], 0, iter(host_pages)
        for dev in on_device:
            if dev is not None:
                addresses.append(dev.data_ptr())
                continue
            pages = next(host_iter)
            page_words[cursor : cursor + pages.size] = pages
            addresses.append(base + pages_at + 8 * cursor)
            cursor += pages.size
        table[:, 0] = addresses
        table[:, 1] = worklist.ls_offsets
        table[:, 2] = worklist.page_offsets
        staging[work_at : work_at + sizes[1]].view(torch.int32).view(n_items, 4).numpy()[:] = worklist.work
        staging[out_at : out_at + sizes[3]].numpy().fill(0)
        inputs.copy_(staging[:total], non_blocking=True)

        out = inputs[out_at : out_at + sizes[3]].view(torch.int64)
        started = done = None
        if self.time_kernels:
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        launch_digest(
            inputs[work_at : work_at + sizes[1]].view(torch.int32).view(n_items, 4),
            inputs[room_at : room_at + sizes[0]].view(torch.int64).view(n_rooms, 3),
            self._layer_table, self._segment_table, out.view(torch.uint64),
            self.layout.row_bytes // 4, slots=self.layout.slots, block=self.block, rows=self.rows,
        )
        keepalive = [staging, inputs, *(d for d in on_device if d is not None)]
        if self.device.type != "cuda":  # the interpreter has run it already
            return PendingDigest(worklist, rooms, callback, out, keepalive=keepalive)
        result = self._pinned.take(sizes[3])
        host = result[: sizes[3]].view(torch.int64)
        host.copy_(out, non_blocking=True)
        done = self._events.take(self.time_kernels)
        done.record()
        return PendingDigest(
            worklist, rooms, callback, host, done, started, keepalive=keepalive, pinned=[staging, result],
        )

    def _warm_up(self) -> None:
        """Compile (or load) the kernel now, at start-up, not on the first room: a cold
        Triton compile takes about a second. An empty room (no frozen slot), never waited
        for; the collector recycles its buffers like any batch's, and counts no room."""
        rooms = [RoomRequest("warm-up", [0], 0)]
        try:
            ticket = self._launch_triton(build_worklist(self.layout, len(self.layer_ids), rooms), rooms, lambda _: None)
        except Exception:
            log.exception("digest kernel warm-up failed; the first room will compile it")
            return
        ticket.counted = False
        self._ensure_thread()
        self._queue.put_nowait(ticket)

    # %% collection

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._collect, name="dsv4-idxk-digest", daemon=True)
                self._thread.start()

    def _collect(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is None:
                return
            while ticket.done is not None and not ticket.done.query():
                time.sleep(self.poll_interval_s)
            try:
                result = self._finish(ticket)
                ticket.callback(result)
            except Exception:  # a callback must never kill the collector
                self.stats.callback_errors += 1
                log.exception("digest callback failed")

    def _finish(self, ticket: PendingDigest) -> BatchResult:
        out = ticket.host_out
        out = (out.numpy() if isinstance(out, torch.Tensor) else out).view(np.uint64)
        wl = ticket.worklist
        n_layers, n_segments = len(self.layer_ids), len(self.layout.segments)
        digests = []
        for slot, room in enumerate(ticket.rooms):
            ls = wl.ls_offsets[slot]
            po = wl.page_offsets[slot]
            digests.append(
                RoomDigest(
                    key=room.key,
                    signature=self.signature,
                    n_tokens=room.n_tokens,
                    layer_ids=self.layer_ids,
                    segments=self.layout.segment_names,
                    layer_segment=out[ls : ls + n_layers * n_segments].reshape(n_layers, n_segments).copy(),
                    pages=out[po : po + room.n_pages].copy(),
                )
            )
        gpu_seconds = None
        if ticket.started is not None and ticket.done is not None:
            gpu_seconds = ticket.started.elapsed_time(ticket.done) / 1000.0
        if ticket.counted:
            self.stats.completed_rooms += len(digests)
        ticket.final_rooms = ticket.room_digests.copy()
        for buffer in ticket.pinned:  # results are copied out above; the event has completed
            self._pinned.give(buffer)
        ticket.pinned.clear()
        if ticket.done is not None and ticket.started is None:
            self._events.give(ticket.done)  # re-recorded by a later batch: ready() no longer asks it
            ticket.done = None
        ticket.keepalive.clear()
        per_room = np.bincount(wl.work[:, 0], weights=wl.work[:, 3], minlength=len(ticket.rooms)) if len(wl.work) else ()
        room_bytes = tuple(int(n) * self._frozen_bytes_per_slot for n in per_room)
        return BatchResult(digests, len(wl.work), sum(room_bytes), gpu_seconds, room_bytes)
