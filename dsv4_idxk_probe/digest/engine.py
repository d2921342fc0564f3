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
from .pinned import PinnedPool
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
    host_rooms: Any  # the room digests alone, likewise
    done: Any = None  # CUDA event; None when the result is already on the host
    started: Any = None  # CUDA timing event
    keepalive: list = field(default_factory=list)  # device inputs that must outlive the kernel
    pinned: list = field(default_factory=list)  # staging buffers to give back once done
    final_rooms: np.ndarray | None = None  # a private copy, once collected

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    @property
    def room_digests(self) -> np.ndarray:
        """uint64 [n_rooms], in submit order."""
        if self.final_rooms is not None:
            return self.final_rooms
        out = self.host_rooms
        return (out.numpy() if isinstance(out, torch.Tensor) else out).view(np.uint64)


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
        if self.backend == "triton" and self.device.type == "cuda":
            # Pinned allocation costs milliseconds: reserve for bursts of
            # single-room batches (up to 64 pages) now rather than on the hot path.
            one_room_items = len(self.layer_ids) * 64
            self._pinned.reserve(24 + 16 * one_room_items, prealloc)
            self._pinned.reserve(8 * (len(self.layer_ids) * len(layout.segments) + 64 + 1), prealloc)
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
            out = self._reference_out(worklist, rooms)
            room_sums = out[: worklist.ls_offsets.size * worklist.ls_size].reshape(len(rooms), -1).sum(axis=1, dtype=np.uint64)
            return PendingDigest(worklist, rooms, callback, out, room_sums)
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

    def _page_table(self, pages: Any) -> torch.Tensor:
        """The room's physical pages as int64 on the kernel's device (no host read-back)."""
        if not isinstance(pages, torch.Tensor):
            pages = torch.as_tensor(np.asarray(pages, dtype=np.int64).reshape(-1))
        return pages.to(device=self.device, dtype=torch.int64, non_blocking=True).contiguous()

    def _launch_triton(self, worklist: WorkList, rooms: list[RoomRequest], callback) -> PendingDigest:
        from .kernel import launch_digest  # Triton is imported only when the kernel is used

        n_rooms, n_items = len(rooms), len(worklist.work)
        page_tables = [self._page_table(room.pages) for room in rooms]

        # One staging buffer in: room table (int64 [R, 3]) then work list (int32 [n, 4]),
        # the work list 256-byte aligned so Triton sees one pointer alignment and
        # compiles the kernel once, whatever the room count.
        room_bytes, work_bytes = -(-24 * n_rooms // 256) * 256, 16 * n_items
        staging = self._pinned.take(room_bytes + work_bytes)
        table = staging[: 24 * n_rooms].view(torch.int64).view(n_rooms, 3).numpy()
        table[:, 0] = [p.data_ptr() for p in page_tables]
        table[:, 1] = worklist.ls_offsets
        table[:, 2] = worklist.page_offsets
        staging[room_bytes : room_bytes + work_bytes].view(torch.int32).view(n_items, 4).numpy()[:] = worklist.work
        inputs = staging[: room_bytes + work_bytes].to(self.device, non_blocking=True)
        room_dev = inputs[: 24 * n_rooms].view(torch.int64).view(n_rooms, 3)
        work_dev = inputs[room_bytes:].view(torch.int32).view(n_items, 4)

        # One result buffer: the kernel's output, then the room digests.
        out = torch.zeros(worklist.out_size + n_rooms, dtype=torch.int64, device=self.device)
        started = done = None
        if self.time_kernels:
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        launch_digest(
            work_dev, room_dev, self._layer_table, self._segment_table, out.view(torch.uint64),
            self.layout.row_bytes // 4, slots=self.layout.slots, block=self.block, rows=self.rows,
        )
        # Room digest = every cell folded = sum of the room's (layer, segment) block, mod 2^64.
        ls_blocks = out[: n_rooms * worklist.ls_size].view(n_rooms, worklist.ls_size)
        torch.sum(ls_blocks, dim=1, out=out[worklist.out_size :])
        keepalive = [staging, inputs, out, *page_tables]
        if self.device.type != "cuda":
            return PendingDigest(worklist, rooms, callback, out[: worklist.out_size], out[worklist.out_size :], keepalive=keepalive)
        result = self._pinned.take(8 * out.numel())
        host = result[: 8 * out.numel()].view(torch.int64)
        host.copy_(out, non_blocking=True)
        done = torch.cuda.Event(enable_timing=self.time_kernels)
        done.record()
        return PendingDigest(
            worklist, rooms, callback, host[: worklist.out_size], host[worklist.out_size :], done, started,
            keepalive=keepalive, pinned=[staging, result],
        )

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
        self.stats.completed_rooms += len(digests)
        ticket.final_rooms = ticket.room_digests.copy()
        for buffer in ticket.pinned:  # results are copied out above; the event has completed
            self._pinned.give(buffer)
        ticket.pinned.clear()
        ticket.keepalive.clear()
        frozen_slots = int(wl.work[:, 3].sum(dtype=np.int64)) if len(wl.work) else 0
        return BatchResult(digests, len(wl.work), frozen_slots * self._frozen_bytes_per_slot, gpu_seconds)
