"""The collector of `DigestEngine`: the background thread that finishes batches.

It takes each submitted batch's ticket (`launch.PendingDigest`) from the
engine's bounded queue, records the batch's event on the submit's stream where
the submit left that to it (`engine.RECORDS`), waits for it (`engine.WAITS`), copies
the outputs down where the submit left that to it (`engine.DOWNLOADS`: on a
stream of its own, waiting on an event of its own), makes what the submit did
not (the cell plan, the output views, the rooms' requests), reads the rooms'
folds (folded by the kernel on the device; or folds the cells itself, where
the kernel stored them), gives the staging buffer and the event back to their
pools and hands a `BatchResult` to the batch's callback. Where the kernel
folds, a buffer goes back to its pool only once what its batch wrote on the
device is zero again: the collector zeroes it on its own stream and gives it
back when that is done (`_reclaim`), never waiting for it. Notes (`DigestEngine.post`:
a callable and its argument, no launch) are called in their place in the same
queue, so what a caller posts after a submit runs after that batch's callback.
It alone waits on the GPU: the serving thread never does. A batch whose device
call failed is dropped, its callback told why; a failing callback is counted
and logged; neither ends the thread.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..background import yield_to_serving
from ..safety import record_error
from . import reference
from .launch import PendingDigest, flag_block, fold_block, out_of_range_counts
from .result import RoomDigest
from .room_table import frozen_slots_per_page

log = logging.getLogger(__name__)

#: The most sleeps of `defer_s` an engine may ask for (`defer_rounds`) before a done batch is
#: delivered while submits keep coming (`Collector._defer`).
DEFER_ROUNDS = 4

#: Dropped batches whose device memory a collector keeps referenced (`Collector._hold`).
DROPPED_HELD = 16


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
    # The batch's ticket (`launch.PendingDigest`): which submit this came from.
    ticket: Any = field(default=None, repr=False, compare=False)


class Note:
    """A call the collector makes in its place in the queue (`DigestEngine.post`)."""

    __slots__ = ("call", "arg")
    counted = True

    def __init__(self, call: Callable[[Any], Any], arg: Any):
        self.call, self.arg = call, arg


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


class PageOutOfRange(ValueError):
    """A room's page table names a page outside a registered buffer."""


class Collector:
    """The collecting half of `DigestEngine` (a base class of it, not an object of its own).

    It reads what the engine's constructor sets up: `layout`, `layer_ids`,
    `signature`, `wait`, `poll_interval_s`, `max_poll_interval_s`, `stats`
    (`EngineStats`), and `_tickets` (the queue of submitted batches), `_lock`,
    `_thread`, `_collecting`, `_warm_up_queued`, `_staging`, `_events`, `_held_drops`,
    `_frozen_bytes_per_slot` and `_copy_stream` / `_copied` (made here, on CUDA)."""

    _quiet_at = -1  # the engine's submitted rooms when its serving thread last went quiet (`_defer`)

    def _start_collector(self) -> None:
        """Start the collector thread unless it runs (again, should it ever have died)."""
        with self._lock:
            if not self._collecting:
                self._collecting = True
                self._thread = threading.Thread(target=self._collect, name="dsv4-idxk-digest", daemon=True)
                self._thread.start()

    def _collect(self) -> None:
        try:
            if self.device.type == "cuda":
                # This thread's own work on the GPU (the copies down it makes, the page ids
                # diagnosis copies to the host) goes to a stream of its own, never the
                # serving thread's; it only ever follows events it has waited for.
                try:
                    torch.cuda.set_stream(self._copy_side())
                except Exception:
                    record_error("digest.collector_stream")
            while True:
                ticket = self._tickets.get()
                if ticket is None:
                    return
                if ticket.__class__ is Note:
                    try:
                        ticket.call(ticket.arg)
                    except Exception:
                        self.stats.callback_errors += 1
                        log.exception("digest note failed")
                    continue
                if not ticket.counted and self._warm_up_queued > 0:
                    self._warm_up_queued -= 1
                self._defer("first_call")  # before the batch's first device call (its event's record or wait)
                if self._await(ticket):
                    self._defer("done")
                    self._deliver(ticket, self._finish)
                if self._staging.short:  # a submit found its buffers' class empty: top it up here
                    self._refill()
                if self._tickets.items:
                    yield_to_serving()  # between batches too, when several are waiting
        finally:
            self._collecting = False

    def _defer(self, at: str) -> None:
        """At the engine's `defer_at` (the loop calls this at both places): sleep `defer_s`,
        and again while the serving thread submitted meanwhile, up to `defer_rounds` times,
        before the batch's device calls and Python (its event's wait, the copy down, the
        fold and callbacks: a few hundred us holding the GIL). Why: a
        batch is done ~0.1 ms after its submit, while the serving thread is still busy (the
        Python of its step, a HiCache load's layers), and the collector's every GIL hand-off
        beside it makes it wait and costs its own CPU (measured on an H200: +150 us per
        restore digest call, docs/overhead.md); once it submits nothing for `defer_s` it is
        most likely waiting on its model step, with the GIL free. A verdict comes at most
        `defer_rounds * defer_s` later. The PD engines sleep one round: prefill publishes a
        room's vectors from here, and a decode receipt judged before they are out is neither
        localised nor diagnosed.

        Where (`DEFER_AT`): "first_call" (the default) sleeps before the batch's first
        device call, so during a burst of submits the collector, once woken, makes none
        (with `record` "collector" its event then lands behind the work queued meanwhile on
        that stream); batches submitted before the quiet period began go through without
        sleeping. "done" (the form before 2026-12-05) sleeps once the batch's kernel is
        done and only when no other batch waits. Under submits that never pause for
        `defer_s`, "first_call" finishes one batch per sleep and the rest wait for the next
        quiet period (a serving thread gets one at every model step). Letting every batch
        queued at a sleep's end through at once was tried (2026-12-06, bench/RESULTS.md): on
        a 2-core CPU it cut the serving thread's own buffer allocations in `bench.hook_cost`
        by two thirds; the GPU comparison made that day was void (both columns ran it)."""
        if at != self.defer_at or not self.defer_s:
            return
        stats = self.stats
        if at == "first_call":
            if stats.submitted_rooms == self._quiet_at:
                return  # submitted before the serving thread last went quiet
        elif self._tickets.items:
            return
        for _ in range(self.defer_rounds):
            seen = stats.submitted_rooms
            time.sleep(self.defer_s)
            if stats.submitted_rooms == seen:
                break  # quiet for defer_s: the serving thread has most likely gone to wait
        self._quiet_at = stats.submitted_rooms

    def _refill(self) -> None:
        """Allocate spare staging buffers for the classes submits found empty
        (`StagingPool.refill`), on this thread: the serving thread then finds them."""
        try:
            self._staging.refill()
        except Exception:
            record_error("digest.refill")
            self._staging.short.clear()  # not again and again: a submit that finds one empty asks again

    def _copy_side(self):
        """The collector's stream and the event it waits on for its own copies (made once)."""
        if self._copy_stream is None:
            with self._lock:  # `digest_now` may ask from another thread
                if self._copy_stream is None:
                    self._copied = torch.cuda.Event(blocking=self.wait == "block")
                    self._copy_stream = torch.cuda.Stream(device=self.device)
        return self._copy_stream

    def _fetch_outputs(self, ticket: PendingDigest) -> None:
        """The outputs' copy down that the submit left to this thread (`download`): the
        kernel is done (its event has completed), so a copy on this thread's own stream
        reads what it stored; then wait for that copy alone. Where the kernel folds and
        the copy reaches the end of what the batch wrote (content digests on: decode's
        default), the twin's zeroing rides behind the copy on that stream and the same
        wait covers it, so the buffer goes straight back to its pool (`_release`): two
        device calls fewer per batch than `_zero` (its event's record, a query), each a
        cold driver call after the deferral's sleep (docs/overhead.md)."""
        start, end = ticket.download
        zero = 0
        if self._fold:
            if ticket.folds is None:
                self._views(ticket)  # sets `used`
            if 0 < ticket.used <= end:  # nothing the collector reads later stays on the device
                zero = ticket.used
        self._copy_down_now(ticket.staging, start, end, zero)
        ticket.download = None
        ticket.zeroed = zero > 0

    def _copy_down_now(self, staging, start: int, end: int, zero: int = 0) -> None:
        """Copy bytes [start, end) of a completed batch's twin down and wait for that copy;
        with `zero`, zero the twin's first `zero` bytes behind it, within the same wait."""
        if self.device.type == "cuda":
            stream = self._copy_side()
            with torch.cuda.stream(stream):
                staging.host[start:end].copy_(staging.device[start:end], non_blocking=True)
                if zero:
                    staging.device[:zero].zero_()
            self._copied.record(stream)
            self._copied.synchronize()
        else:
            staging.download(start, end)
            if zero:
                staging.device[:zero].zero_()

    def _await(self, ticket: PendingDigest) -> bool:
        """Wait until the batch's kernel is done. False when a device call failed (the
        event's record at submit, or the wait): the batch is dropped, counted, its
        callback gets a result with `error` set and no digests, and its staging buffer
        is never reused (the GPU may still write it); the collector goes on."""
        if ticket.error is not None:  # counted where it happened
            return self._drop(ticket, ticket.error)
        try:
            if ticket.record_on is not None:
                self._record_now(ticket)
            done = ticket.done
            if done is not None:
                if self.wait == "block":
                    done.synchronize()  # this thread only; the serving thread never waits here
                else:
                    waits = poll_intervals(self.poll_interval_s, self.max_poll_interval_s)
                    while not done.query():
                        time.sleep(next(waits))
            if ticket.download is not None:
                self._fetch_outputs(ticket)
            return True
        except Exception as exc:
            record_error("digest.await")
            return self._drop(ticket, f"{type(exc).__name__}: {exc}")

    def _record_now(self, ticket: PendingDigest) -> None:
        """The batch's event, recorded now on the stream its submit launched on (`record`
        "collector"): behind its kernel, and behind whatever that stream has queued since.
        `done` is set once recorded, then `record_on` cleared (`PendingDigest.ready` reads
        them in the other order)."""
        done = self._events.take()
        self._record(done, ticket.record_on)
        ticket.done = done
        ticket.record_on = None

    def _drop(self, ticket: PendingDigest, error: str) -> bool:
        """A batch that cannot be digested: counted, and its callback told why, so the
        caller stops waiting for its rooms. Its staging buffer and the tables its kernel
        reads stay referenced (`_hold`): the GPU may still be at them."""
        self.stats.dropped_batches += 1
        self._hold(ticket)
        ticket.error = error  # a caller waiting for its digests stops waiting
        self._deliver(ticket, lambda _: BatchResult([], 0, 0, error=error, ticket=ticket))
        return False

    def _hold(self, ticket: PendingDigest) -> None:
        """Keep a dropped batch's memory from its pools and from the allocator: the kernel of
        a batch whose event failed may still write its staging buffer and read its page tables
        (the caller's, and those the submit converted), and memory freed under it would be
        SGLang's next tensor. The newest
        `DROPPED_HELD` drops are held (a failing device drops batch after batch; by the
        time a drop leaves the window, the kernels before it have long ended or never will)."""
        self._held_drops.append((ticket.staging, ticket.keepalive, ticket.one, ticket.rooms))  # the rooms: the caller's page tables

    def _deliver(self, ticket: PendingDigest, result: Callable[[PendingDigest], BatchResult]) -> None:
        """Hand the batch's result to its callback. A result that cannot be made (the fold,
        a copy down of its flags) drops the batch as `_drop` does: counted, its callback told
        why (its staging buffer is not reused: the failure may be the device's). A failing
        callback is counted and logged. Neither ends the collector."""
        try:
            batch = result(ticket)
        except Exception as exc:
            record_error("digest.finish")
            self._drop(ticket, f"{type(exc).__name__}: {exc}")
            return
        try:
            ticket.callback(batch)
        except Exception:
            self.stats.callback_errors += 1
            log.exception("digest callback failed")

    def _release(self, ticket: PendingDigest) -> None:
        """Give a completed batch's staging buffer and event back to their pools (where the
        kernel folds, once what the batch wrote on the device is zeroed: `_zero`, or already
        behind the copy down, `_fetch_outputs`)."""
        if ticket.staging is not None:
            if ticket.folds is not None and not ticket.zeroed:
                self._zero(ticket.staging, ticket.used)
            else:
                self._staging.give(ticket.staging)
            ticket.staging = None
        if ticket.done is not None and ticket.started is None:
            self._events.give(ticket.done)  # re-recorded by a later batch: ready() no longer asks it
            ticket.done = None
        ticket.keepalive = ()

    def _zero(self, staging, nbytes: int) -> None:
        """Zero the first `nbytes` of a buffer's twin (the batch's kernel and copies are
        done), on this thread's stream, and give the buffer back once that is done
        (`_reclaim`): the next batch's kernel adds its folds into zeros."""
        if self.device.type != "cuda":
            staging.device[:nbytes].zero_()
            self._staging.give(staging)
            return
        if self._zeroing:
            self._reclaim()
        try:
            staging.device[:nbytes].zero_()
            zeroed = self._events.take()
            zeroed.record()
        except Exception:
            record_error("digest.zero")  # never reused: a later batch must not add into what is left
            return
        with self._zeroing_lock:
            self._zeroing.append((zeroed, staging))

    def _reclaim(self) -> None:
        """Give back to their pools the buffers whose zeroing is done (oldest first)."""
        with self._zeroing_lock:
            zeroing = self._zeroing
            try:
                while zeroing and zeroing[0][0].query():
                    zeroed, staging = zeroing.popleft()
                    self._events.give(zeroed)
                    self._staging.give(staging)
            except Exception:
                record_error("digest.reclaim")

    def _folded(self, ticket: PendingDigest) -> tuple[list, list[int]]:
        """Each room's fold as the kernel added it up (copies: the buffer is reused), and
        its rows out of range; the flags too (a copy down and a wait, here) when a room
        has such rows and they did not come down with the outputs."""
        plan, n_segments = ticket.plan, self._n_segments
        folds = [fold_block(plan, ticket.folds, slot, n_segments) for slot in range(len(plan.page_counts))]
        out_of_range = [unread for _, _, unread in folds]
        if any(out_of_range) and not self.contents:
            self._copy_down_now(ticket.staging, ticket.flags_at, ticket.flags_at + ticket.n_cells)
        add = np.add.reduce  # not `ndarray.sum`, which adds a Python frame per call
        return [(add(copies, axis=0, dtype=np.uint64), pages.copy()) for copies, pages, _ in folds], out_of_range

    def _finish(self, ticket: PendingDigest) -> BatchResult:
        """Each room's fold (the event has completed), then recycle the buffers."""
        if (ticket.cells is None and ticket.folds is None) or ticket.rooms is None:
            self._views(ticket)  # what a lean submit left to this thread
        if ticket.contents_only:
            return self._finish_contents(ticket)
        plan, digests, room_bytes = ticket.plan, [], []
        if ticket.folds is not None:
            folded, out_of_range = self._folded(ticket)
        else:
            folded, out_of_range = None, out_of_range_counts(plan, ticket.flags)
        page_counts, segments, layout = plan.page_counts, self.layout.segment_names, self.layout
        signature, layer_ids, n_layers = self.signature, self.layer_ids, len(self.layer_ids)
        add = np.add.reduce  # not `ndarray.sum`, which adds a Python frame per call
        room_values = []
        for slot, room in enumerate(ticket.rooms):
            if folded is not None:
                layer_segment, pages = folded[slot]
            else:
                layer_segment, pages = reference.fold_cells(plan.block(ticket.cells, slot))
            outside = out_of_range[slot]
            digests.append(
                RoomDigest(
                    key=room.key,
                    # Rows not read make the digest worthless: a signature no other digest
                    # has, so every comparison says not_comparable, never match.
                    signature=signature if not outside else secrets.randbits(64),
                    n_tokens=room.n_tokens,
                    layer_ids=layer_ids,
                    segments=segments,
                    layer_segment=layer_segment,
                    pages=pages,
                )
            )
            room_values.append(add(layer_segment, axis=None, dtype=np.uint64) if not outside else secrets.randbits(64))
            n_pages = page_counts[slot]
            frozen = min(max(room.n_tokens, 0) // layout.tokens_per_slot, n_pages * layout.slots)
            unread = 0
            if outside:  # rows not read are not digested bytes
                per_page = frozen_slots_per_page(layout, n_pages, room.n_tokens)
                unread = int(flag_block(plan, ticket.flags, slot).sum(axis=0, dtype=np.int64) @ per_page)
            room_bytes.append((frozen * n_layers - unread) * self._frozen_bytes_per_slot)
        gpu_seconds = None
        if ticket.started is not None and ticket.done is not None:
            gpu_seconds = ticket.started.elapsed_time(ticket.done) / 1000.0
        ticket.unread = tuple(out_of_range)  # before the room digests: they tell a reader it may read both
        ticket.final_rooms = np.array(room_values, dtype=np.uint64)
        room_contents = self._hand_back(ticket, out_of_range)
        return BatchResult(digests, plan.n_cells, sum(room_bytes), gpu_seconds, tuple(room_bytes),
                           out_of_range=tuple(out_of_range), contents=room_contents, ticket=ticket)

    def _finish_contents(self, ticket: PendingDigest) -> BatchResult:
        """A contents-only batch: its contents and out-of-range rows, no fold."""
        out_of_range = out_of_range_counts(ticket.plan, ticket.flags)
        ticket.final_rooms = np.zeros(0, dtype=np.uint64)  # never folded: no room digests to read
        room_contents = self._hand_back(ticket, out_of_range)
        return BatchResult([], ticket.plan.n_cells, 0, out_of_range=tuple(out_of_range), contents=room_contents,
                           ticket=ticket)

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

    def _count_out_of_range(self, rooms: list, out_of_range: list[int]) -> None:
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
