"""Digest rooms of one index-K pool without stalling the caller: the engine's facade.

`DigestEngine.submit` launches a batch on the caller's current stream in
two to four device calls, whatever the batch (`launch.py`: its tables read by
the kernel from a pinned staging buffer in place, or copied up for big launches, the Triton kernel,
its outputs copied down unless the collector does it, `DOWNLOADS`, a CUDA
event right behind unless the collector records it, `RECORDS`; `OUTPUTS`), and
queues its ticket, the queue bounded
(`max_pending`); `submit_room` is the same for one room without a request
object. A background thread (`collector.py`) waits for the event (`WAITS`),
folds the cells into room digests and hands them to the callback. The
caller's thread never calls ``.item()``, ``.cpu()``, ``.tolist()`` or a
synchronise on this path, and does nothing there that can wait for the
collector (docs/overhead.md, "What the serving thread does").

Without CUDA the same API digests with the NumPy reference (or with the
Triton kernel under ``TRITON_INTERPRET=1``), at submit time so the snapshot
is the same, and still delivers results on the background thread.

This module holds what callers use: the engine, its options, and the types it
hands out (`PendingDigest` from `launch.py`, `BatchResult` from
`collector.py`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..background import HandOff
from .collector import DEFER_ROUNDS, DROPPED_HELD, BatchResult, Collector, Note
from .launch import FOLD_SLICES, Launcher, PendingDigest, kernel_shape, staging_bytes
from .layout import RowLayout, layout_signature
from .pinned import EventPool, StagingPool
from .result import RoomDigest
from .room_table import RoomRequest

__all__ = ["BACKENDS", "DEFER_AT", "DEPENDENT_LAUNCHES", "DOWNLOADS", "OUTPUTS", "RECORDS", "WAITS", "BatchResult",
           "DigestEngine", "EngineStats", "PendingDigest"]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "reference")
# How the collector waits for a batch's event. "block": one synchronise on a
# blocking-sync event, the thread asleep in the driver with the GIL released,
# woken once when the kernel is done. "poll": query it, sleeping between
# (`collector.poll_intervals`); each wake-up takes the GIL and makes a driver call.
WAITS = ("block", "poll")
# Where the kernel reads its tables and stores its outputs. "device": the staging
# buffer's device twin, one copy up (when it reads a table) and one down per batch;
# "pinned": the pinned host buffer itself, no copies, but each row's outputs cross
# PCIe as small writes, which makes fp8 rooms slower on the GPU (large rooms far
# slower) and gains nothing on bf16 rows (bench/RESULTS.md).
OUTPUTS = ("device", "pinned")
# How the kernel is launched. "auto": a programmatic dependent launch where the GPU
# has them (compute capability 9 and later), a plain one elsewhere; "off": plain.
DEPENDENT_LAUNCHES = ("auto", "off")
# Who copies the outputs down (outputs "device"). "submit": the submit, right behind the
# kernel, so the room digest is readable once the caller's stream is past it (prefill's
# in-band slot, enforce's judge); "collector": the collector thread, once the batch's
# event has completed, on a stream of its own: one device call fewer on the serving
# thread (decode, which reads its digests only on the collector).
DOWNLOADS = ("submit", "collector")
# Who records a batch's CUDA event (download "collector" only). "submit": the submit, right
# behind its kernel (the PD engines: the collector must not wait behind the next forward the
# serving thread enqueues). "collector": the collector, on the submit's stream, when it takes
# the batch: a submit is its launch alone, and the event also waits for what that stream has
# queued since (HiCache restore engines: their copy streams queue more copies, not forwards).
RECORDS = ("submit", "collector")
DEFER_AT = ("first_call", "done")  # where the collector's deferral sits (`Collector._defer`)


@dataclass
class EngineStats:
    submitted_rooms: int = 0
    completed_rooms: int = 0
    dropped_batches: int = 0
    callback_errors: int = 0
    out_of_range_rooms: int = 0  # rooms with a page id outside a registered buffer
    out_of_range_rows: int = 0  # their (layer, page) rows, never read
    copied_tables: int = 0  # launches whose tables were copied up (one more device call), not read in place


class DigestEngine(Launcher, Collector):
    """Digests rooms of one pool: `buffers[i]` is layer `layer_ids[i]`, uint8 [pages, row_bytes].

    `contents`: whether results carry each cell's content digest (what the
    diagnosis needs); without, its copy down and its copy out are spared.
    `outputs`: where the kernel reads and stores (`OUTPUTS`).
    `dependent_launch` (`DEPENDENT_LAUNCHES`): "auto" launches the kernel as a
    programmatic dependent launch where the GPU has them (compute capability 9
    and later): it starts as the kernel before it drains instead of after it
    (back-to-back fp4 rooms read a little faster, bench/RESULTS.md) and reads
    the same bytes; "off": plain launches.
    `download` (`DOWNLOADS`): who copies the outputs down, the submit ("submit",
    the default) or the collector ("collector").
    `record` (`RECORDS`): who records a batch's event, the submit ("submit", the
    default) or, with `download` "collector" and `time_kernels` off, the collector.
    `mapped_tables`: the kernel reads a launch's room table (and page ids that travel
    with it) from the pinned staging buffer through its own address, where the driver
    maps it so (`pinned.device_maps_host_pointer`), for launches of at most
    `mapped_table_programs` programs: no copy up, one device call fewer. Larger
    launches, or False, copy the tables up to the twin (`stats.copied_tables`).
    `spare_buffers`: when a submit finds its staging buffers' size class empty (and so
    allocates on the caller's thread), the collector allocates this many more of that
    class (`StagingPool.refill`); 0: never.
    `fold`: the kernel folds each room's cells on the device, so only the folds come down
    (with `outputs` "device"); False: it stores the cells and the collector folds them.
    `defer_s`: how long the collector sleeps, while the serving thread keeps submitting,
    before it takes on a batch (`Collector._defer`, where: `defer_at`); 0: at once.
    `defer_rounds`: that many sleeps at most, the next only when the serving thread
    submitted during the last (1 for the PD sides; HiCache restore engines ask for more).
    `defer_at` (`DEFER_AT`): the sleep comes before the batch's first device call
    ("first_call") or once its kernel is done ("done").
    `page_id_stride`: entries of a page table per page; page k's id is entry
    k x stride over stride (negative: out of range); a trailing group of fewer
    entries is a page too (as `table[::stride]` counts). A HiCache copy names its pages
    by token index, `page_size` per page; with the stride the kernel reads those
    indices as they are, so the copying thread launches no division of its own.

    The launch path is `launch.Launcher`, the collector thread
    `collector.Collector`: both are parts of this class and read the
    attributes set up here."""

    def __init__(
        self,
        layout: RowLayout,
        layer_ids: Sequence[int],
        buffers: Sequence[torch.Tensor],
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
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
        download: str = "submit",
        mapped_tables: bool = True,
        mapped_table_programs: int = 16384,
        spare_buffers: int = 4,
        fold: bool = True,
        defer_s: float = 0.0,
        defer_rounds: int = 1,
        defer_at: str = "first_call",
        page_id_stride: int = 1,
        record: str = "submit",
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if wait not in WAITS:
            raise ValueError(f"wait must be one of {WAITS}, got {wait!r}")
        if outputs not in OUTPUTS:
            raise ValueError(f"outputs must be one of {OUTPUTS}, got {outputs!r}")
        if dependent_launch not in DEPENDENT_LAUNCHES:
            raise ValueError(f"dependent_launch must be one of {DEPENDENT_LAUNCHES}, got {dependent_launch!r}")
        if download not in DOWNLOADS:
            raise ValueError(f"download must be one of {DOWNLOADS}, got {download!r}")
        if record not in RECORDS:
            raise ValueError(f"record must be one of {RECORDS}, got {record!r}")
        if record == "collector" and (download != "collector" or time_kernels):
            raise ValueError("record 'collector' needs download 'collector' and time_kernels off")
        if not isinstance(page_id_stride, int) or page_id_stride < 1:
            raise ValueError(f"page_id_stride must be an integer of at least 1, got {page_id_stride!r}")
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
            if buf.data_ptr() % 4:  # the kernel reads whole words: it would start before the buffer
                raise ValueError(f"buffer {i} (layer {layer_ids[i]}) does not start on a 4-byte boundary")
        self.layout = layout
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.signature = layout_signature(layout, self.layer_ids)
        self.buffers = list(buffers)
        self.device = torch.device(device) if device is not None else (buffers[0].device if buffers else torch.device("cpu"))
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "reference"
        self.backend = backend
        # Rows per program and warps: the fastest on an H200 (`launch.kernel_shape`).
        shape = kernel_shape(layout)
        self.rows = rows or shape["rows"]
        self.num_warps = num_warps or shape["num_warps"]
        self.outputs = outputs
        self.dependent_launch = dependent_launch
        self.download = download
        self._copies = outputs == "device"  # the kernel reads and stores the twin, copied up and down
        # The kernel folds each room's cells on the device (into the twin, kept at zero between
        # batches by the collector), so only the folds come down: with the twin only (atomics
        # into pinned host memory cross PCIe, if the bus has them at all).
        self._fold = self._copies and backend == "triton" and fold
        # a one-room launch's fold beyond its page vector (`launch.fold_words`)
        self._fold_room_words = FOLD_SLICES * len(self.layer_ids) * len(layout.segments) + 1
        self._zeroing: deque = deque()  # (event, staging buffer) whose zeroing is on its way (collector.py)
        self._zeroing_lock = threading.Lock()
        self.mapped_tables = mapped_tables
        self._mapped_table_programs = mapped_table_programs if mapped_tables else -1  # launch.py reads this
        self._download_at_submit = download == "submit"
        self.record = record
        self._record_at_submit = record == "submit"  # launch.py reads this per submit
        self._n_layers, self._n_segments = len(self.layer_ids), len(layout.segments)
        self.page_id_stride = page_id_stride  # launch.py reads it per submit
        self._staging = StagingPool(self.device, twin=self._copies, spare=spare_buffers)
        self.wait = wait
        self._events = EventPool(blocking=wait == "block")
        if self.device.type == "cuda":
            self._events.reserve(prealloc, self.device)  # created now: a serving thread's first batches create none
        if self.backend == "triton" and self.device.type == "cuda":
            # Pinned allocation costs milliseconds: reserve now, not on the hot path,
            # for bursts of batches up to the smallest size class (64 KiB), and of
            # single-room batches up to 64 pages where those need more.
            self._staging.reserve(staging_bytes(32 + 64, len(self.layer_ids) * 64, len(layout.segments)), prealloc)
        if not 0.0 <= defer_s <= 1.0:
            raise ValueError(f"defer_s must be within [0, 1] seconds, got {defer_s!r}")
        if not 1 <= defer_rounds <= DEFER_ROUNDS:
            raise ValueError(f"defer_rounds must be within [1, {DEFER_ROUNDS}], got {defer_rounds!r}")
        if defer_at not in DEFER_AT:
            raise ValueError(f"defer_at must be one of {DEFER_AT}, got {defer_at!r}")
        self.defer_s = defer_s
        self.defer_rounds = defer_rounds
        self.defer_at = defer_at
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
        self._warm_up_queued = 0  # start-up batches waiting in the queue: they take no caller's place
        self._held_drops: deque = deque(maxlen=DROPPED_HELD)  # dropped batches' memory (`Collector._hold`)
        self._lock = threading.Lock()
        self._streams: dict[int, Any] = {}  # raw stream handle -> its torch stream
        self._copy_stream = self._copied = None  # the collector's own stream and event (collector.py)
        # The device touch points of a submit (launch.py), looked up once here; tests and
        # benches replace them to take the CUDA path without a GPU.
        self._on_cuda = self.device.type == "cuda"  # a submit records an event and launches on a stream
        self._device_index = self.device.index if self.device.index is not None else 0
        self._direct: list = [None, None]  # DirectLaunch for several rooms, for one (launch.py)
        self._direct_refused = [False, False]
        if self._on_cuda:
            self._device_index = torch.cuda.current_device() if self.device.index is None else self.device.index
            self._current_device = torch._C._cuda_getDevice
            self._raw_stream = torch._C._cuda_getCurrentRawStream
            self._record = torch._C._CudaEventBase.record
        if self.backend == "triton":
            from . import kernel as kernel_module  # Triton: only here

            self._current_stream = kernel_module.current_stream
            self._launch_hooks = kernel_module._HOOKS
            # Each layer's buffer, global id and page count; the kernel reads it on the device.
            self._layer_table, base_align = kernel_module.layer_table(self.buffers, self.layer_ids, self.device)
            self._kernel = kernel_module.DigestKernel(
                self._layer_table, len(self.layer_ids), layout, rows=self.rows, num_warps=self.num_warps,
                base_align=base_align, contents=contents, fold=self._fold,
                pdl=dependent_launch == "auto" and kernel_module.dependent_launches_on(self.device),
                id_stride=page_id_stride,
            )
            self._layer_table_address = self._kernel.layer_table_address
            if self.device.type == "cuda":
                self._warm_up()

    @classmethod
    def from_config(cls, layout: RowLayout, layer_ids: Sequence[int], buffers: Sequence[torch.Tensor], config: Any, *,
                    role: str, page_id_stride: int = 1) -> "DigestEngine":
        """An engine set up by the probe config (its `digest` section), for `role`'s side;
        `page_id_stride`: how the side's page tables come (SGLang's prefill: token indices)."""
        return cls(layout, layer_ids, buffers, page_id_stride=page_id_stride, **cls.role_options(config, role))

    @staticmethod
    def role_options(config: Any, role: str) -> dict:
        """The keyword arguments `from_config` gives an engine of `role`'s side (benches that
        build engines of their own take them from here): content digests only on decode with
        diagnosis on, the one reader of them."""
        decode = role == "decode"
        # Decode reads its digests on the collector alone, unless enforce judges receipts
        # on the serving thread (sglang/pd_decode.mismatch_flags): then, like prefill's
        # in-band slot, they must be readable once the stream is past the kernel.
        download = "collector" if decode and not getattr(config, "enforce", False) else "submit"
        return {"wait": config.digest.collector_wait, "outputs": config.digest.outputs,
                "dependent_launch": config.digest.dependent_launch, "defer_s": config.digest.collector_defer_ms / 1000,
                "defer_at": config.digest.collector_defer_at,
                "contents": decode and config.diagnosis.enabled, "download": download}

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
        rooms = rooms if rooms.__class__ is list else list(rooms)
        ticket = self._launch(rooms, callback)
        if contents_only:
            ticket.contents_only = True
        if not self._collecting:
            self._start_collector()
        self.stats.submitted_rooms += len(rooms)  # before the hand-off: the collector's deferral reads it
        self._tickets.put(ticket)
        return ticket

    def submit_room(self, key: str, pages: Any, n_tokens: int, callback: Callable[[BatchResult], None], *,
                    contents_only: bool = False, table: tuple | None = None) -> PendingDigest | None:
        """`submit` of one room, (`key`, `pages`, `n_tokens`) as a `RoomRequest` holds them:
        the serving thread's common call (a receipt, a finish, a send, a snapshot), made
        without a request object (the collector makes it) and with one Python frame on
        the Triton backend. `table`: the `PendingDigest.table` of an earlier submit of the
        same page table (the room's receipt), so this one asks the tensor nothing."""
        if self.__class__.submit is not _SUBMIT or (
                "submit" in self.__dict__ and not getattr(self.__dict__["submit"], "times_only", False)):
            # `submit` is replaced (a test's fake, the sync audit's self-test): it sees
            # every submit, this one as a batch of one. A timer that only measures
            # (`times_only`) leaves a one-room submit its own path.
            rooms = [RoomRequest(key, pages, n_tokens)]
            return self.submit(rooms, callback, contents_only=True) if contents_only else self.submit(rooms, callback)
        if len(self._tickets.items) - self._warm_up_queued >= self.max_pending:
            self.stats.dropped_batches += 1
            return None
        if self.backend == "triton":
            ticket = self._launch_one(key, pages, n_tokens, callback, contents_only, table)
        else:
            ticket = self._launch([RoomRequest(key, pages, n_tokens)], callback)
        if contents_only:
            ticket.contents_only = True
        if not self._collecting:
            self._start_collector()
        self.stats.submitted_rooms += 1  # before the hand-off: the collector's deferral reads it
        self._tickets.put(ticket)
        return ticket

    def post(self, call: Callable[[Any], Any], arg: Any = None) -> None:
        """Have the collector call `call(arg)` once every batch submitted before this has
        been delivered (never dropped, never launched): bookkeeping a serving thread hands
        on, in order with its digests. A failing call is counted and logged."""
        if not self._collecting:
            self._start_collector()
        self._tickets.put(Note(call, arg))

    def backlog(self) -> int:
        """Batches submitted whose results the collector has not delivered yet."""
        return len(self._tickets.items)

    def digest_now(self, rooms: Sequence[RoomRequest]) -> list[RoomDigest]:
        """Digest and wait: for tests, tools and host memory, never for the scheduler thread."""
        ticket = self._launch(list(rooms), lambda _: None)
        if ticket.record_on is not None:
            self._record_now(ticket)
        if ticket.done is not None:
            ticket.done.synchronize()
        if ticket.download is not None:
            self._fetch_outputs(ticket)
        return self._finish(ticket).digests

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver what is pending, then stop the collector thread."""
        thread = self._thread
        if thread is None:
            return
        self._tickets.put(None)
        thread.join(timeout_s)
        self._thread = None

    # %% start-up

    def _warm_up(self) -> None:
        """Compile (or load) the kernel now, at start-up, not on the first room: a cold
        Triton compile takes about a second. An empty room (no frozen slot), never waited
        for; the collector recycles its buffers like any batch's, and counts no room. On
        CUDA, both compiled variants (one room by value, several from a table), each
        launched a second time for its `DirectLaunch` to be learnt (launch.py): the
        serving thread's first rooms launch direct."""
        page = [0] * self.page_id_stride  # one page's entries
        batches = [[RoomRequest("warm-up", page, 0)]]
        if self._on_cuda:
            if self._direct[1] is None and not self._direct_refused[1]:
                batches.append(batches[0])
            pair = [RoomRequest("warm-up", page, 0), RoomRequest("warm-up/1", page, 0)]
            if self._direct[0] is None and not self._direct_refused[0]:
                batches += [pair, pair]
        for rooms in batches:
            try:
                ticket = self._launch(rooms, lambda _: None)
            except Exception:
                log.exception("digest kernel warm-up failed; the first room will compile it")
                return
            ticket.counted = False
            self._start_collector()
            self._warm_up_queued += 1
            self._tickets.put(ticket)


_SUBMIT = DigestEngine.submit  # as defined here: `submit_room` tells a wrapped one apart
