"""The launch path of `DigestEngine`: what a submit does on the caller's thread, never waiting.

A submit takes a pinned staging buffer from its pool, writes what the kernel
must read from the host (a room table for several rooms; page ids that live
on the host) into its front, where the kernel reads it through the pinned
buffer's own address (for launches of up to `mapped_table_programs` programs,
where the driver maps pinned memory so; else it is copied up to the buffer's
device twin first), launches the Triton kernel on the caller's current stream,
and records a CUDA event right behind (the ticket's `done`). A room whose page table lives
on the kernel's device is read in place, and a launch of one such room takes
its fields by value: then the kernel reads no table and nothing is copied up.
The kernel adds each room's cells into its folds (the (layer, segment)
matrix, the page vector and a count of rows not read: `kernel.py`, FOLD) and
stores out-of-range flags and (for diagnosis) content digests into the back
of the twin; one copy brings the folds (and the contents, where asked) down,
either at the submit (`download="submit"`: where a caller reads the room digest as soon as
its stream is past the kernel, prefill's in-band slot) or on the collector
thread once the event has completed (`download="collector"`, decode: one
device call fewer on the serving thread). What the submit returns, the
batch's ticket (`PendingDigest`), goes to the collector (`collector.py`).
Nothing here synchronises: the caller's thread never calls ``.item()``,
``.cpu()``, ``.tolist()`` or a synchronise on this path.

What stays on the caller's thread is what has to happen at that instant: the
kernel's launch, reading the pages as the stream has them there, and the event
behind it. Everything else waits for the collector: the cell plan, the views
of the outputs, the rooms' request objects, and the copy down where allowed.
The submit itself is written for a thread that comes back to it after a model
step, where each Python function entered and each object made costs tens of
microseconds (docs/overhead.md): one Python frame for a one-room submit (the
ticket is made without one), C calls for the device work, and the compiled
kernel's C launch function called directly with its arguments packed once
(`DirectLaunch`), not through Triton's Python launcher.

Why the event is recorded on the caller's thread, although that is one more
call there: recorded later, by the collector, it lands behind whatever the
caller enqueued meanwhile, typically the next forward, so the collector wakes
when that forward ends, the very moment the serving thread wakes to take
its results, and both want the GIL (docs/overhead.md). Recorded at once, it
completes a few microseconds after the kernel, and the collector does its
Python work while the serving thread waits for its forward.

Without CUDA the same path digests with the NumPy reference (or with the
Triton kernel under ``TRITON_INTERPRET=1``), at submit time so the snapshot
is the same; the collector still delivers the results.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from ..safety import record_error
from . import reference
from .layout import RowLayout
from .pinned import _MIN_BYTES, Staging

_MIN_WORDS = _MIN_BYTES // 8
from .room_table import ROOM_COLUMNS, CellPlan, RoomRequest, frozen_slots_per_page, plan_cells

if TYPE_CHECKING:
    from .collector import BatchResult

_Tensor = torch.Tensor
_new = object.__new__
# Bytes per page id of the page tables the kernel reads in place.
_ID_BYTES = {torch.int32: 4, torch.int64: 8}
_NOT_ONE_ROOM = (0, 0, 0, 0)  # the by-value room fields of a launch of several rooms


class PendingDigest:
    """A submitted batch (its ticket). `room_digests` is readable once `ready()` on an
    engine that copies its outputs down at submit (prefill's: once the submitting stream
    has been synchronised by someone else, as SGLang's NIXL path does before sending,
    which is how the in-band slot is filled); on one that leaves the copy to the
    collector (decode's), reading it waits for the collector.

    A submit makes its ticket without running Python code (`object.__new__`, then the
    attributes it knows), so most attributes have class-level defaults; the collector
    fills in the rest (`plan`, `rooms`, the output views) from the staging buffer."""

    plan: CellPlan | None = None  # where each room's cells sit; made by the collector for a lean submit
    rooms: list | None = None  # room requests (anything with key, pages, n_tokens), in submit order
    one: tuple | None = None  # (key, pages, n_tokens) of a one-room submit, until `rooms` is made
    callback: Callable[[BatchResult], None] | None = None
    cells: np.ndarray | None = None  # uint64 [n_cells, n_segments], filled by the kernel (or the reference)
    folds: np.ndarray | None = None  # uint64: the rooms' folds, where the kernel folded on the device (`fold_block`)
    flags_at: int = 0  # byte offset of the flags in the staging buffer (a collector fetches them when it must)
    used: int = 0  # bytes of the twin the batch wrote: zeroed before its reuse where the kernel folds
    zeroed: bool = False  # the collector zeroed those bytes behind its copy down (`Collector._fetch_outputs`)
    done: Any = None  # CUDA event; None when the cells are already on the host
    started: Any = None  # CUDA timing event
    staging: Staging | None = None  # to give back once done
    keepalive: Any = ()  # device inputs that must outlive the kernel
    final_rooms: np.ndarray | None = None  # a private copy, once collected
    unread: Sequence[int] | None = None  # per room: its rows never read (out of range); set with the room digests
    counted: bool = True  # False for the engine's own warm-up batches
    error: str | None = None  # recording `done` failed (or the collector dropped the batch): why
    flags: np.ndarray | None = None  # uint8 [n_cells]: 1 where the row's page id was out of range
    contents: np.ndarray | None = None  # uint64 [n_cells, n_segments]: each cell's content digest
    contents_only: bool = False  # the caller wants the contents alone: no fold, no digests (see `submit`)
    owner: Any = None  # the engine: the output views are made from its layout on demand
    at: int = 0  # word offset of the cells in the staging buffer
    n_cells: int = 0
    page_counts: Sequence[int] | None = None  # per room, for the plan (a lean submit of several rooms)
    firsts: Sequence[int] | None = None  # per room: its first cell row (likewise)
    download: tuple[int, int] | None = None  # bytes [start, end) the collector still has to copy down
    record_on: Any = None  # the submit's stream, where the collector records `done` (`record` "collector")
    # (address, bytes per id, pages) of a one-room submit's page table, read in place: a
    # later submit of the same tensor passes it back (`submit_room(table=)`, or a room
    # request's `table`) and asks the tensor nothing
    table: tuple | None = None

    def __init__(self, plan: CellPlan, rooms: list, callback: Callable[[BatchResult], None], cells: np.ndarray,
                 done: Any = None, started: Any = None, staging: Staging | None = None, keepalive: Any = (), *,
                 flags: np.ndarray | None = None, contents: np.ndarray | None = None):
        """A ticket whose outputs are already in place (the reference backend, tests)."""
        self.plan, self.rooms, self.callback, self.cells = plan, rooms, callback, cells
        self.done, self.started, self.staging, self.keepalive = done, started, staging, keepalive
        self.flags, self.contents = flags, contents
        self.n_cells = plan.n_cells

    def ready(self) -> bool:
        """Whether the kernel has run: its pages may be reused, and on an engine that copies
        its outputs down at submit `room_digests` is readable. Never, for a batch whose
        event failed."""
        if self.error is not None:
            return False
        unrecorded = self.record_on  # before `done`: the collector sets `done` first, then clears this
        done = self.done  # read once: the collector clears it when it recycles the event
        if done is None:
            return unrecorded is None  # no event to ask yet: not known to be done
        return done.query()

    def wait(self) -> bool:
        """Block until `room_digests` is readable: a host sync, for enforce mode only.
        False, at once, for a batch whose event failed: its digests never will be."""
        if self.error is not None:
            return False
        done = self.done
        if done is not None:
            done.synchronize()  # if recycled meanwhile, this waits for a later batch: longer, still right
        if self.download is not None or self.record_on is not None:
            return self._collected()
        return self.error is None

    def _collected(self, timeout_s: float = 60.0) -> bool:
        """Wait for the collector to have copied the outputs down (or dropped the batch)."""
        deadline = time.monotonic() + timeout_s
        while self.download is not None and self.final_rooms is None and self.error is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0002)
        return self.error is None

    @property
    def room_digests(self) -> np.ndarray:
        """uint64 [n_rooms], in submit order: the sum mod 2^64 of each room's cells; a
        fresh random value for a room with out-of-range page ids (it must match nothing)."""
        if self.final_rooms is not None:
            return self.final_rooms
        if self.download is not None:
            self._collected()
            if self.final_rooms is not None:
                return self.final_rooms
        if self.cells is None and self.folds is None and self.owner is not None:
            self.owner._views(self)
        if self.folds is not None:
            n_segments = self.owner._n_segments
            blocks = [fold_block(self.plan, self.folds, i, n_segments) for i in range(len(self.plan.page_counts))]
            self.unread = [unread for _, _, unread in blocks]
            return np.array([pages.sum(dtype=np.uint64) if not unread else secrets.randbits(64)
                             for _, pages, unread in blocks], dtype=np.uint64)
        self.unread = unread = out_of_range_counts(self.plan, self.flags)
        return np.array([self.plan.block(self.cells, i).sum(dtype=np.uint64) if not n else secrets.randbits(64)
                         for i, n in enumerate(unread)], dtype=np.uint64)

    def whole_room_digest(self, i: int = 0) -> int | None:
        """Room `i`'s digest, or None where some of its rows were never read (a page id out of
        range): its `room_digests` value is then random, so that it matches nothing, and it
        must judge nothing either (enforce's drop, the in-band slot). Readable when
        `room_digests` is."""
        value = int(self.room_digests[i])
        unread = self.unread
        return None if unread is not None and unread[i] else value


def _known_tables(rooms: list, n_layers: int) -> tuple[list, int]:
    """A batch's room table, flat, and its cell rows in all, where every room carries its
    page table as an earlier submit found it on the device (`PendingDigest.table`:
    address, bytes per id, pages): each row that table plus (tokens, first cell row).
    Raises TypeError at a room without one (None), AttributeError at an object without
    `table`: the caller then builds the table from the pages (`Launcher._room_table`).

    Why a plain loop: under CPython 3.11 it is the cheapest way to copy a few fields per
    room (measured against the former per-room pass and against chains of `map`,
    `accumulate` and `chain`, which run no bytecode per room but allocate more and took
    longer; bench/RESULTS.md, 2026-12-03)."""
    table: list = []
    total = 0
    for room in rooms:
        known = room.table
        table += known  # TypeError for None
        table += (room.n_tokens, total)
        total += n_layers * known[2]
    return table, total


def out_of_range_counts(plan: CellPlan, flags: np.ndarray | None) -> list[int]:
    """Per room: its (layer, page) rows flagged as out of range."""
    # nearly every batch: one pass over a byte per row (the ufunc called directly: `ndarray.any`
    # adds a Python frame, on the collector for every batch)
    if flags is None or not np.logical_or.reduce(flags, axis=None):
        return [0] * len(plan.page_counts)
    return [int(flag_block(plan, flags, i).sum()) for i in range(len(plan.page_counts))]


# Copies of its (layer, segment) matrix the kernel adds a launch's one room into, program
# by program (its first page mod FOLD_SLICES), summed by the host. Why: one copy takes each
# of a layer's pages' atomics on one address (1,024 serialised adds for a 1,024-page
# room, the size whose GPU time counts). A launch of several rooms (decode's steps:
# short rooms) adds into one copy per room.
FOLD_SLICES = 16


def _slices(n_rooms: int) -> int:
    return FOLD_SLICES if n_rooms == 1 else 1


def fold_words(page_counts: Sequence[int], n_layers: int, n_segments: int) -> int:
    """Words of a launch's folds (`kernel.py`, FOLD): per room its page vector, its
    (layer, segment) matrices (`_slices` of them) and its count of rows not read."""
    return sum(page_counts) + len(page_counts) * (_slices(len(page_counts)) * n_layers * n_segments + 1)


def fold_block(plan: CellPlan, folds: np.ndarray, slot: int, n_segments: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Room `slot`'s fold, as the kernel adds it up (views into `folds`): its (layer,
    segment) matrix's copies uint64 [copies, layers, segments] (their sum is the matrix),
    its page vector uint64 [pages] (its sum is the room digest), and its (layer, page)
    rows not read (out of range). It sits at (its first cell) / layers + slot x (copies x layers x segments
    + 1) words, the page vector first."""
    n_layers, n_pages = plan.n_layers, plan.page_counts[slot]
    slices = _slices(len(plan.page_counts))
    matrix_words = slices * n_layers * n_segments
    before = plan.first_cells[slot] // n_layers if n_layers else sum(plan.page_counts[:slot])
    base = before + slot * (matrix_words + 1)
    matrix = folds[base + n_pages : base + n_pages + matrix_words].reshape(slices, n_layers, n_segments)
    return matrix, folds[base : base + n_pages], int(folds[base + n_pages + matrix_words])


def flag_block(plan: CellPlan, flags: np.ndarray, slot: int) -> np.ndarray:
    """Room `slot`'s out-of-range flags as uint8 [layers, pages] (a view)."""
    first, n_pages = plan.first_cells[slot], plan.page_counts[slot]
    return flags[first : first + plan.n_layers * n_pages].reshape(plan.n_layers, n_pages)


def staging_bytes(input_words: int, n_cells: int, n_segments: int) -> int:
    """A batch's staging buffer where the kernel stores its cells (`Launcher` sizes a
    folding launch's own): its tables, then its cells, then a flag byte per cell row
    (padded to 8 bytes), then the cells' contents."""
    return 8 * (input_words + 2 * n_cells * n_segments + -(-n_cells // 8))


def strided_page_ids(pages, stride: int) -> np.ndarray:
    """Page ids from a table of `stride` entries per page, as the kernel reads it
    (`page_id_stride`): each page's first entry over the stride, floored; -1 (out of
    range) for a negative entry; a trailing group shorter than the stride is a page too,
    as `entries[::stride]` counts it. For the reference backend."""
    entries = np.asarray(pages.cpu() if isinstance(pages, _Tensor) else pages, dtype=np.int64)
    firsts = entries[::stride]
    return np.where(firsts >= 0, firsts // stride, -1)


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


# Rows per program and warps per program, fastest on an H200 per layout in the sweep
# of bench/RESULTS.md (steady timing): one row per program, one warp for rows up to
# 8448 B (no cross-warp reduction, 16 loads of 16 B in flight per thread), four for
# larger rows; the digests are the same whatever they are.
def kernel_shape(layout: RowLayout) -> dict:
    if layout.row_bytes <= 8448:
        return {"rows": 1, "num_warps": 1}
    return {"rows": 1, "num_warps": 4}


class HooksSet(LookupError):
    """A Triton launch hook is set (a profiler): `DirectLaunch.learn` launches nothing and
    learns nothing; it may learn later, once no hook is set."""


#: Held while `DirectLaunch.learn` has a compiled kernel's launcher wrapped (engines on
#: several threads share the compiled kernel: PD's on the serving thread, HiCache's on the copying one).
_LEARNING = threading.Lock()


class DirectLaunch:
    """The compiled kernel's C launch function and the arguments it always gets, packed once.

    Triton's launcher (`CompiledKernel.run`, a `CudaLauncher`) is Python: per launch it
    looks up the active driver, makes two closures, asks for scratch memory (none for
    this kernel) and then calls the C launch function with the grid, the stream, a run of
    arguments that never change for this kernel (its function handle, launch flags,
    metadata, hooks, argument annotations: which, and in what order, depends on the
    Triton release) and the kernel's own arguments. `learn` makes one real launch
    through `run` with that C function wrapped, to see exactly what `run` passes it;
    later launches call it with the same constant run and their own grid, stream and
    arguments, as one C call. Used only where `run` asks for no scratch memory and its
    call was understood; otherwise launches keep going through `DigestKernel.launch`.

    `spread`: the kernel's arguments follow the constant run one by one (Triton up to
    3.6); else as one tuple (later releases). `tail`: the kernel's constant arguments
    (the layout's constants, ONE_ROOM, CONTENTS, PDL). `hooks`: Triton's launch hooks as
    they were when learnt; a launch made while a hook is set (a profiler) goes through
    Triton's own path, which calls the hooks."""

    __slots__ = ("fn", "head", "tail", "spread", "enter", "leave", "enter_calls", "leave_calls")

    def __init__(self, fn, head, tail, spread, enter, leave, enter_calls, leave_calls):
        self.fn, self.head, self.tail, self.spread = fn, head, tail, spread
        self.enter, self.leave, self.enter_calls, self.leave_calls = enter, leave, enter_calls, leave_calls

    @staticmethod
    def learn(compiled, grid: tuple, stream: int, args: tuple, n_varying: int, hooks: Any) -> "DirectLaunch | None":
        """Launch `compiled` through its own launcher once with `args` (its first
        `n_varying` change per launch, the rest never do) and learn how to call the C
        function directly. Returns None, having launched, when the call was not understood;
        raises, having launched nothing, when `run` cannot be used this way."""
        with _LEARNING:  # one learner at a time: another would take this one's recorder for the C function
            run = compiled.run
            inner = getattr(run, "launch", None)
            if (not callable(inner) or getattr(run, "global_scratch_size", None) != 0
                    or getattr(run, "profile_scratch_size", 0) != 0 or getattr(run, "gsan_enabled", False)):
                raise LookupError("this Triton's launcher is not one a direct launch understands")
            enter, leave = getattr(hooks, "launch_enter_hook", None), getattr(hooks, "launch_exit_hook", None)
            calls = []
            for hook in (enter, leave):
                chain = getattr(hook, "calls", None)
                if hook is None:
                    calls.append(())
                elif isinstance(chain, list) and not chain:
                    calls.append(chain)  # an empty chain of hooks: read again at every launch
                else:
                    raise HooksSet("a Triton launch hook is set: launches keep Triton's path")
            seen = []

            def recorder(*call):
                seen.append(call)
                return inner(*call)

            own = "launch" in vars(run)
            try:
                run.launch = recorder
            except Exception as exc:
                raise LookupError("this Triton's launcher cannot be wrapped") from exc
            try:
                run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)
            finally:
                if own:
                    run.launch = inner
                else:
                    del run.launch
        if len(seen) != 1:
            return None
        call, n = seen[0], len(args)
        if call[:4] != (*grid, stream):
            return None
        if len(call) > 4 + n and call[-n:] == args:
            head, spread = call[4:-n], True
        elif len(call) > 5 and isinstance(call[-1], tuple) and call[-1] == args:
            head, spread = call[4:-1], False
        else:
            return None
        if not any(value is compiled.function for value in head):
            return None
        return DirectLaunch(inner, head, args[n_varying:], spread, enter, leave, *calls)

    def quiet(self, hooks: Any) -> bool:
        """No launch hook set since this was learnt (the engine inlines this test)."""
        return (hooks.launch_enter_hook is self.enter and hooks.launch_exit_hook is self.leave
                and not self.enter_calls and not self.leave_calls)


class Launcher:
    """The launch half of `DigestEngine` (a base class of it, not an object of its own).

    It reads what the engine's constructor sets up: `layout`, `layer_ids`, `buffers`,
    `device`, `backend`, `contents`, `time_kernels`, and `_copies` (outputs "device"),
    `_download_at_submit`, `_staging` (`StagingPool`), `_events` (`EventPool`),
    `_streams`, `_n_layers`, `_n_segments`, `page_id_stride`, and for the Triton backend `_kernel`,
    `_current_stream` and the device touch points of the lean path: `_on_cuda`,
    `_device_index`, `_current_device`, `_raw_stream`, `_record`, `_direct`,
    `_launch_hooks` (tests and benches fake these)."""

    def _launch(self, rooms: list, callback) -> PendingDigest:
        """Launch a batch of room requests (anything with `key`, `pages`, `n_tokens`)."""
        if self.backend == "reference":
            if self.page_id_stride != 1:
                rooms = [RoomRequest(r.key, strided_page_ids(r.pages, self.page_id_stride), r.n_tokens) for r in rooms]
            plan = plan_cells(rooms, self._n_layers)
            cells, contents, flags = self._reference_cells(plan, rooms)
            return PendingDigest(plan, rooms, callback, cells, flags=flags, contents=contents if self.contents else None)
        if len(rooms) == 1:
            room = rooms[0]
            ticket = self._launch_one(room.key, room.pages, room.n_tokens, callback)
            ticket.rooms = rooms
            return ticket
        return self._launch_many(rooms, callback)

    def _reference_cells(self, plan: CellPlan, rooms: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The cells, contents and out-of-range flags the kernel stores, computed with the reference."""
        cells = np.zeros((plan.n_cells, self._n_segments), dtype=np.uint64)
        contents = np.zeros_like(cells)
        flags = np.zeros(plan.n_cells, dtype=np.uint8)
        for slot, room in enumerate(rooms):
            pages = room.pages.cpu().numpy() if isinstance(room.pages, torch.Tensor) else room.pages
            checked_room_cells(self.buffers, pages, room.n_tokens, self.layout, self.layer_ids,
                               plan.block(cells, slot), flag_block(plan, flags, slot), plan.block(contents, slot))
        return cells, contents, flags

    def _odd_device_pages(self, pages: Any) -> torch.Tensor | None:
        """A page table on the kernel's device that is not a plain contiguous int32 or int64
        tensor, made one (one more device op, for odd callers only); None for page ids
        that travel in the staging buffer (host containers, tensors elsewhere)."""
        if not isinstance(pages, torch.Tensor) or pages.device != self.device:
            return None
        if pages.dtype not in _ID_BYTES or not pages.is_contiguous():
            pages = pages.to(dtype=torch.int64).contiguous()
        return pages

    def _launch_one(self, key: str, pages: Any, n_tokens: int, callback, contents_only: bool = False,
                    table: tuple | None = None) -> PendingDigest:
        """One room: its fields go to the kernel by value, so with its page table on the
        device the kernel reads no table and nothing is copied up. On CUDA: the launch and
        the event, plus the copy down where the engine makes it at submit. `table`: the
        page table's (address, bytes per id, pages) as an earlier submit of the same
        tensor found it (`PendingDigest.table`), so this one asks the tensor nothing."""
        n_layers, n_seg = self._n_layers, self._n_segments
        if table is not None:
            dev, input_words, n_pages = pages, 32, table[2]
        elif (pages.__class__ is _Tensor and pages.device == self.device and pages.dtype in _ID_BYTES
                and pages.is_contiguous()):
            dev, input_words, n_pages = pages, 32, pages.shape[0]  # read in place (`len` of a tensor is Python)
            if self.page_id_stride != 1:  # a trailing partial group is a page, as `pages[::stride]` counts it
                n_pages = -(-n_pages // self.page_id_stride)
        else:
            dev = self._odd_device_pages(pages)
            entries = len(pages)
            n_pages = -(-entries // self.page_id_stride)
            input_words = 32 if dev is not None else -(-(ROOM_COLUMNS + entries) // 32) * 32
        n_cells = n_layers * n_pages
        fold = self._fold
        cells_end = input_words + (n_pages + self._fold_room_words if fold else n_cells * n_seg)  # the cells or the fold
        contents_start = cells_end + ((n_cells + 7) >> 3)
        contents_end = contents_start + n_cells * n_seg
        staging = None
        if contents_end <= _MIN_WORDS:  # nearly every room: the smallest class, popped without a lock
            try:
                staging = self._staging.min_free.pop()
            except IndexError:
                pass
        if staging is None:
            staging = self._staging.take(8 * contents_end)
        copies = self._copies  # else the kernel reads and stores the pinned buffer
        base = staging.device_address if copies else staging.host_address
        started = None
        if self.time_kernels:
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        ticket = _new(PendingDigest)
        if table is not None:
            address, id_bytes = table[0], table[1]
            ticket.table = table
        elif dev is not None:
            address, id_bytes = dev.data_ptr(), _ID_BYTES[dev.dtype]
            if dev is pages:  # the caller's own tensor, which it keeps: later submits may read it so
                ticket.table = (address, id_bytes, n_pages)
            else:  # a converted copy: alive until the kernel is done, never offered for reuse
                ticket.keepalive = (dev,)
        else:  # the page ids travel in the staging buffer, after the (unread) room table row
            staging.words[ROOM_COLUMNS : ROOM_COLUMNS + entries] = pages.cpu() if isinstance(pages, _Tensor) else pages
            id_bytes = 8
            in_place = n_cells <= self._mapped_table_programs * self.rows and self._staging.mapped
            address = (staging.host_address if in_place else base) + 8 * ROOM_COLUMNS  # `_launch_many`
            if copies and not in_place:
                self.stats.copied_tables += 1
                up = 8 * (ROOM_COLUMNS + entries)
                try:
                    to, of = staging.pairs[0, up, False]
                except KeyError:
                    to, of = staging.pair(0, up, False)
                to.copy_(of, non_blocking=True)
        cells_at, flags_at, contents_at = base + 8 * input_words, base + 8 * cells_end, base + 8 * contents_start
        ticket.owner, ticket.callback, ticket.staging = self, callback, staging
        ticket.at, ticket.n_cells, ticket.one = input_words, n_cells, (key, pages, n_tokens)
        if started is not None:
            ticket.started = started
        if not self._on_cuda:  # the interpreter runs the kernel now, on no stream
            if n_cells:
                self._kernel.launch(base, cells_at, contents_at, flags_at, 1, n_pages,
                                    one_room=(address, id_bytes, n_pages, n_tokens))
            if copies:
                self._copy_down(ticket, staging, input_words, cells_end, contents_end, contents_only)
            return ticket
        index = self._device_index
        raw = self._raw_stream(index)
        if n_cells:
            direct, hooks = self._direct[1], self._launch_hooks
            if (direct is not None and self._current_device() == index and hooks.launch_enter_hook is direct.enter
                    and hooks.launch_exit_hook is direct.leave and not direct.enter_calls and not direct.leave_calls):
                if direct.spread:
                    direct.fn(1, n_layers, -(-n_pages // self.rows), raw, *direct.head, base,
                              self._layer_table_address, cells_at, contents_at, flags_at, address, id_bytes,
                              n_pages, n_tokens, *direct.tail)
                else:
                    direct.fn(1, n_layers, -(-n_pages // self.rows), raw, *direct.head,
                              (base, self._layer_table_address, cells_at, contents_at, flags_at, address, id_bytes,
                               n_pages, n_tokens) + direct.tail)
            else:
                self._launch_slowly(True, base, cells_at, contents_at, flags_at, 1, n_pages,
                                    (address, id_bytes, n_pages, n_tokens))
        if copies:  # the outputs' copy down (`_copy_down`, inlined), now or by the collector
            start = 8 * cells_end if contents_only else 8 * input_words
            end = 8 * contents_end if self.contents else 8 * cells_end + (0 if fold and not contents_only else n_cells)
            if self._download_at_submit:
                try:
                    to, of = staging.pairs[start, end, True]
                except KeyError:
                    to, of = staging.pair(start, end, True)
                to.copy_(of, non_blocking=True)
            else:
                ticket.download = (start, end)
        # the batch's event (`_record_done`, inlined)
        try:
            stream = self._streams[raw]
        except KeyError:
            stream = self._stream_object(raw)
        if not self._record_at_submit:  # the collector records it (`record` "collector")
            ticket.record_on = stream
            return ticket
        if started is None:
            try:
                done = self._events._free.pop()
            except IndexError:
                done = self._events.take()
        else:
            done = self._events.take(True)
        ticket.done = done
        try:
            self._record(done, stream)
        except Exception as exc:
            record_error("digest.record")
            ticket.error = f"{type(exc).__name__}: {exc}"
        return ticket

    def _launch_many(self, rooms: list, callback) -> PendingDigest:
        """Several rooms in one launch: the kernel reads each room's row of a room table
        (page-table address, bytes per id, pages, tokens, first cell row), with the page
        ids that live on the host after it, straight from the pinned staging buffer
        through its own address (`StagingPool.mapped`; the buffer goes back to its pool
        only once the batch's event has completed, so no later submit rewrites a table a
        kernel may still read). Two device calls on CUDA for decode's step: the launch and
        the event (plus the copy down where the submit makes it). A launch of more than
        `mapped_table_programs` programs, or where the driver does not map pinned memory
        at its own address, copies the tables up to the twin first (one more device call,
        counted in `stats.copied_tables`): each program reads its room's row, which
        across PCIe would slow a big launch's kernel.
        Where every room's page table was found on the device by an earlier submit (its
        `table`: decode's stepped and finishing rooms, found at their receipts), a tight
        loop copies those rows (`_known_tables`, a few bytecodes and no call per room);
        otherwise one pass over the rooms builds the table (`_room_table`), where a room
        with a known `table` still costs no call on the tensor."""
        n_rooms, n_layers, n_seg = len(rooms), self._n_layers, self._n_segments
        hosts = None  # (slot, pages, entries) of rooms whose page ids travel in the staging buffer
        host_words = 0
        converted = None  # page tables made contiguous for the kernel: kept alive until it is done
        try:
            table, total = _known_tables(rooms, n_layers)
        except (AttributeError, TypeError):  # a room without a known page table (or a request without `table`)
            table, hosts, host_words, total, max_pages, converted = self._room_table(rooms)
            page_counts = table[2::5]
        else:
            page_counts = table[2::5]
            max_pages = max(page_counts, default=0)
        firsts = table[4::5]
        table_words = ROOM_COLUMNS * n_rooms
        input_words = -(-(table_words + host_words) // 32) * 32  # cells 256-byte aligned
        # the cells, or the rooms' folds (`fold_words`)
        cells_end = input_words + (sum(page_counts) + n_rooms * (n_layers * n_seg + 1) if self._fold else total * n_seg)
        contents_start = cells_end + ((total + 7) >> 3)
        contents_end = contents_start + total * n_seg
        staging = None
        if contents_end <= _MIN_WORDS:  # the smallest class, popped without a lock
            try:
                staging = self._staging.min_free.pop()
            except IndexError:
                pass
        if staging is None:
            staging = self._staging.take(8 * contents_end)
        copies = self._copies
        base = staging.device_address if copies else staging.host_address
        blocks = -(-max_pages // self.rows)  # the grid's third dimension
        # Where the kernel reads the tables: the pinned buffer itself, at its own address
        # (`StagingPool.mapped`), up to `mapped_table_programs` programs (each reads its
        # room's row across PCIe); else the twin, copied up: one more device call.
        tables = (staging.host_address if n_rooms * n_layers * blocks <= self._mapped_table_programs
                  and self._staging.mapped else base)
        words = staging.words
        cursor = table_words
        if hosts is not None:
            for slot, pages, entries in hosts:
                words[cursor : cursor + entries] = pages.cpu() if isinstance(pages, _Tensor) else pages
                table[ROOM_COLUMNS * slot] = tables + 8 * cursor
                cursor += entries
        words[:table_words] = table
        started = None
        if self.time_kernels:
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        if copies and tables == base:
            up = 8 * cursor
            try:
                to, of = staging.pairs[0, up, False]
            except KeyError:
                to, of = staging.pair(0, up, False)
            to.copy_(of, non_blocking=True)
            self.stats.copied_tables += 1
        cells_at, flags_at, contents_at = base + 8 * input_words, base + 8 * cells_end, base + 8 * contents_start
        ticket = _new(PendingDigest)
        ticket.owner, ticket.callback, ticket.staging, ticket.rooms = self, callback, staging, rooms
        ticket.at, ticket.n_cells, ticket.page_counts, ticket.firsts = input_words, total, page_counts, firsts
        if converted:
            ticket.keepalive = converted
        if started is not None:
            ticket.started = started
        if not self._on_cuda:
            self._kernel.launch(tables, cells_at, contents_at, flags_at, n_rooms, max_pages)
            if copies:
                self._copy_down(ticket, staging, input_words, cells_end, contents_end, False)
            return ticket
        index = self._device_index
        raw = self._raw_stream(index)
        if max_pages and n_layers:
            direct, hooks = self._direct[0], self._launch_hooks
            if (direct is not None and self._current_device() == index and hooks.launch_enter_hook is direct.enter
                    and hooks.launch_exit_hook is direct.leave and not direct.enter_calls and not direct.leave_calls):
                if direct.spread:
                    direct.fn(n_rooms, n_layers, blocks, raw, *direct.head, tables,
                              self._layer_table_address, cells_at, contents_at, flags_at, *_NOT_ONE_ROOM, *direct.tail)
                else:
                    direct.fn(n_rooms, n_layers, blocks, raw, *direct.head,
                              (tables, self._layer_table_address, cells_at, contents_at, flags_at, *_NOT_ONE_ROOM)
                              + direct.tail)
            else:
                self._launch_slowly(False, tables, cells_at, contents_at, flags_at, n_rooms, max_pages, None)
        if copies:
            self._copy_down(ticket, staging, input_words, cells_end, contents_end, False)
        self._record_done(ticket, raw)
        return ticket

    def _room_table(self, rooms: list) -> tuple[list, list | None, int, int, int, list | None]:
        """A batch's room table, one room at a time: (the table, flat; the rooms whose page
        ids travel in the staging buffer, as (slot, pages, n); their words; cell rows in
        all; the most pages of a room; the page tables converted for the kernel, which the
        batch must keep alive until its kernel is done). A host room's address is filled
        in once the staging buffer is known."""
        n_layers, device = self._n_layers, self.device
        table: list = []  # ROOM_COLUMNS ints per room, flat
        hosts = converted = None
        total = host_words = max_pages = 0
        for slot, room in enumerate(rooms):
            known = getattr(room, "table", None)  # as an earlier submit found it: nothing to ask the tensor
            if known is not None:
                n = known[2]
                table += (known[0], known[1], n, room.n_tokens, total)
            else:
                pages = room.pages
                if (pages.__class__ is _Tensor and pages.device == device and pages.dtype in _ID_BYTES
                        and pages.is_contiguous()):
                    dev = pages
                    entries = pages.shape[0]
                else:
                    dev = self._odd_device_pages(pages)
                    entries = len(pages)
                    if dev is not None and dev is not pages:
                        if converted is None:
                            converted = []
                        converted.append(dev)
                n = -(-entries // self.page_id_stride)  # pages (`page_id_stride` entries each, the last maybe fewer)
                if dev is not None:
                    table += (dev.data_ptr(), _ID_BYTES[dev.dtype], n, room.n_tokens, total)
                else:  # its address is known once the staging buffer is: filled in below
                    table += (0, 8, n, room.n_tokens, total)
                    if hosts is None:
                        hosts = []
                    hosts.append((slot, pages, entries))
                    host_words += entries
            total += n_layers * n
            if n > max_pages:
                max_pages = n
        return table, hosts, host_words, total, max_pages, converted

    def _copy_down(self, ticket: PendingDigest, staging: Staging, input_words: int, cells_end: int,
                   contents_end: int, contents_only: bool) -> None:
        """The outputs' copy down (outputs "device"): now, or marked for the collector.
        Without diagnosis it stops before the contents (half the bytes or more), and
        where the kernel folds, before the flags too (the collector fetches them for a
        batch with rows out of range); a contents-only batch skips the cells (or folds)."""
        start = 8 * cells_end if contents_only else 8 * input_words
        end = 8 * contents_end if self.contents else 8 * cells_end + (
            0 if self._fold and not contents_only else ticket.n_cells)
        if self._download_at_submit:
            try:
                to, of = staging.pairs[start, end, True]
            except KeyError:
                to, of = staging.pair(start, end, True)
            to.copy_(of, non_blocking=True)
        else:
            ticket.download = (start, end)

    def _record_done(self, ticket: PendingDigest, raw: int) -> None:
        """The batch's event, from the pool, recorded right behind the launch (why here:
        the module's docstring). A failed record is the batch's error: the serving thread
        goes on, the collector drops the batch. (`_launch_one` has this inlined.) With
        `record` "collector", only the stream is noted: the collector records the event."""
        try:
            stream = self._streams[raw]
        except KeyError:
            stream = self._stream_object(raw)
        if not self._record_at_submit:
            ticket.record_on = stream
            return
        if ticket.started is None:
            try:
                done = self._events._free.pop()
            except IndexError:
                done = self._events.take()
        else:  # timed: an event of its own, never pooled
            done = self._events.take(True)
        ticket.done = done
        try:
            self._record(done, stream)
        except Exception as exc:
            record_error("digest.record")
            ticket.error = f"{type(exc).__name__}: {exc}"

    def _launch_slowly(self, one: bool, base: int, cells_at: int, contents_at: int, flags_at: int, n_rooms: int,
                       max_pages: int, one_room: tuple | None) -> None:
        """A launch through `DigestKernel.launch`: until the kernel is compiled, while a
        launch hook is set, on another current device, or on a Triton whose launcher a
        `DirectLaunch` does not understand. Once the compiled kernel fits, the launch
        after it is learnt from (`DirectLaunch.learn`), and later ones go direct."""
        device, raw = self._current_stream()
        kernel, variant = self._kernel, one_room is not None
        compiled = kernel.compiled.get(variant)
        if (compiled is not None and self._direct[one] is None and not self._direct_refused[one]
                and device == self._device_index and kernel.compiled_on.get(variant) == device):
            args = kernel.launch_args(base, cells_at, contents_at, flags_at, one_room)
            try:
                self._direct[one] = DirectLaunch.learn(compiled, (n_rooms, self._n_layers, -(-max_pages // self.rows)),
                                                       raw, args, 9, self._launch_hooks)
                if self._direct[one] is None:
                    self._direct_refused[one] = True
                return  # launched, learnt or not
            except HooksSet:
                pass
            except LookupError:
                self._direct_refused[one] = True
        kernel.launch(base, cells_at, contents_at, flags_at, n_rooms, max_pages, one_room=one_room, device=device,
                      stream=raw)

    def _stream_object(self, raw_stream: int):
        """The torch stream of a raw handle, to record events on: made once per stream
        (a serving thread launches on the same few), not once per batch; looking up
        the current torch stream costs more than the record itself."""
        # the torch stream `raw_stream` was read from
        stream = self._streams[raw_stream] = torch.cuda.current_stream(self._device_index)
        return stream

    def _views(self, ticket: PendingDigest) -> None:
        """The ticket's plan, output views and room requests, from its staging buffer (the
        collector makes them; a caller reading `room_digests` early, too)."""
        n_layers, n_seg, n_cells, staging = self._n_layers, self._n_segments, ticket.n_cells, ticket.staging
        if ticket.plan is None:
            if ticket.one is not None:
                n_pages = n_cells // n_layers if n_layers else len(ticket.one[1])
                ticket.plan = CellPlan((0,), (n_pages,), n_layers, n_cells, n_pages)
            else:
                counts = tuple(ticket.page_counts)
                ticket.plan = CellPlan(tuple(ticket.firsts), counts, n_layers, n_cells, max(counts, default=0))
        if ticket.rooms is None:
            ticket.rooms = [RoomRequest(*ticket.one)]
        if ticket.cells is None and ticket.folds is None and staging is not None:
            at = ticket.at
            words = staging.words
            if self._fold:
                cells_end = at + fold_words(ticket.plan.page_counts, n_layers, n_seg)
                ticket.folds = words[at:cells_end].view(np.uint64)
            else:
                cells_end = at + n_cells * n_seg
                ticket.cells = words[at:cells_end].view(np.uint64).reshape(-1, n_seg)
            ticket.flags_at = 8 * cells_end
            ticket.flags = words.view(np.uint8)[8 * cells_end : 8 * cells_end + n_cells]  # no torch call
            start = cells_end + ((n_cells + 7) >> 3)
            ticket.used = 8 * start
            if self.contents:
                ticket.contents = words[start : start + n_cells * n_seg].view(np.uint64).reshape(-1, n_seg)
                ticket.used = 8 * (start + n_cells * n_seg)
