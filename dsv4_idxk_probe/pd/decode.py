"""Decode side: digest each room when it lands and later in its life, and judge it.

Stages: `decode_recv` (transfer complete, before the first decode forward),
`decode_step` (every N steps, frozen bytes only), `decode_finish` (before the
pages are released). Each is compared with the prefill digest: the in-band
room digest decides match/mismatch; the full vectors, fetched from the
prefill side's exchange on mismatch (or always, if configured), localise it.
The first stage that mismatches is remembered, so a room reads as
"intact at receipt, corrupt by step 40".
"""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Any, Callable, Sequence

from ..background import yield_to_serving
from ..digest.engine import BatchResult, DigestEngine, PendingDigest
from ..digest.result import Comparison, RoomDigest, compare
from ..metrics.definitions import ProbeMetrics, counter_add
from ..safety import record_error, safe_invoke
from .coverage import RoomCoverage, estimated_bytes, judged_reason, outcome_of, skip_reason, stage_signatures
from .inband import InbandDigest
from .records import room_record
from .rooms import RoomId

Emit = Callable[[dict], Any]
_monotonic_ns = time.monotonic_ns  # one clock read per serving-thread event (the journal's and latency's)
FetchVectors = Callable[[str], "RoomDigest | None"]
# A room whose prefill vectors could not be fetched (prefill busy, not yet published) asks
# again at its next digests, this many times in all: one slow answer must not cost a room its
# localisation for life, nor a dead peer a fetch per digest.
MAX_FETCHES_PER_ROOM = 3
# A room received again while tracked (its key moved a second time, as a rebootstrap after a
# retraction that no hook saw moves it): the first transfer's record, counted as retracted.
RECEIVED_AGAIN = "retracted: received again"
# What the collector's guarded call of `_on_result` returns when it failed (it returns None).
_NOT_JUDGED = object()

DigestObserver = Callable[[list[tuple[RoomId, str, "int | None"]]], Any]
_digest_observers: list[DigestObserver] = []  # add_digest_observer; none in production


def add_digest_observer(observer: DigestObserver) -> None:
    """Call `observer(points)` whenever a DecodeMonitor in this process takes digests.

    `points` lists each digest as (RoomId, stage, step), step None but at
    `decode_step`; the call comes on the submitting (serving) thread right
    before the digests are enqueued, so the pages still hold what they will
    read (a test bed checks them there). Fail-open: an observer that raises is
    logged once and counted (`safety.record_error`, site
    ``decode.digest_observer``), never raised into the monitor's caller.
    """
    _digest_observers.append(observer)


def remove_digest_observer(observer: DigestObserver) -> None:
    """Undo `add_digest_observer`."""
    try:
        _digest_observers.remove(observer)
    except ValueError:
        pass


class _Room:
    """A received room, as decode tracks it. Made on the serving thread at receipt (one
    Python frame: no dataclass machinery, no default factories); its verdict state is
    the collector's."""

    __slots__ = ("room", "key", "pages", "n_tokens", "inband", "extra", "expected", "fetches", "first_divergence",
                 "finished", "retired", "unsafe", "tickets", "in_flight", "table", "coverage", "digest_record")

    def __init__(self, room: RoomId, pages: Any, n_tokens: int, inband: InbandDigest | None,
                 extra: dict | None = None):
        self.room = room
        self.key = room.key  # a room request too (key, pages, n_tokens): the engine digests states as they are
        self.pages = pages
        self.n_tokens = n_tokens
        self.inband = inband
        self.extra = extra if extra is not None else {}  # goes into every record of the room
        self.expected: RoomDigest | None = None  # full prefill digest, once fetched
        self.fetches = 0  # fetches of it that failed (each later digest of the room may try again)
        self.first_divergence: str | None = None
        self.finished = False
        self.retired: str | None = None  # why the room stopped being tracked (retraction, abort)
        self.unsafe: Any = ()  # its batches whose kernel had not run when it was retired
        # Its batches whose results have not come back: the serving thread appends, the
        # collector removes (each one C call, atomic under the GIL; read at retirement).
        self.tickets: list = []
        self.in_flight = 0  # kept for callers that count; nothing here reads it
        # its page table as the receipt's submit found it on the device (address, bytes per
        # id, pages): later digests of the room (steps, finish) ask the tensor nothing
        self.table: tuple | None = None
        # what became of its bytes (pd/coverage.py), made by the collector at its first verdict
        # (none made here: the serving thread's receipt stays one frame); counted once, untracked
        self.coverage: RoomCoverage | None = None
        # its last digest's bytes and record (`DecodeMonitor._digest_record`), on the collector
        self.digest_record: tuple | None = None


class DecodeMonitor:
    """Tracks received rooms and turns decode-side digests into verdicts.

    On the serving thread each event does what must happen at that instant and no
    more: the room's state made or looked up, its digest launched (`DigestEngine.
    submit_room`, or one `submit` for a batch), one clock read. The rest, the journal
    events of diagnosis (allocated, landed, freed, each with the time the serving thread
    saw), the verdicts, records and metrics, and the bookkeeping of rooms retired,
    evicted or dropped, happens on the collector thread, in order with the digests
    (`DigestEngine.post` for what has no digest of its own)."""

    def __init__(
        self,
        engine: DigestEngine,
        emit: Emit,
        metrics: ProbeMetrics | None = None,
        *,
        fetch_vectors: FetchVectors | None = None,
        fetch_always: bool = False,
        step_interval: int = 0,
        on_verdict: Callable[[RoomId, str, str, Comparison | None], Any] | None = None,
        max_rooms: int | None = None,
        diagnosis: Any = None,
        snapshot_on_allocation: bool = False,
    ):
        self.engine = engine
        self.emit = emit
        self.metrics = metrics
        self._digest_metric_children: dict[tuple, tuple] = {}  # (stage, verdict) -> `_digest_metrics`
        self.fetch_vectors = fetch_vectors
        self.fetch_always = fetch_always
        self.step_interval = step_interval
        self.on_verdict = on_verdict
        self.max_rooms = max_rooms  # rooms tracked at once; the oldest is dropped (as `skipped`) beyond it
        # diagnosis.DecodeDiagnosis, or None: what a mismatch's bad cells became (docs/diagnosis.md)
        self.diagnosis = diagnosis
        self.snapshot_on_allocation = snapshot_on_allocation and diagnosis is not None
        self._rooms: dict[str, _Room] = {}
        self._lock = threading.Lock()
        # a room's coverage is folded on the collector and, when the digest queue is full, on
        # the serving thread: each fold reads then writes, so the two take turns
        self._coverage_lock = threading.Lock()
        # the engine's queue, read for its length: a snapshot waits behind half of it at most
        self._queue = engine._tickets.items if hasattr(engine, "_tickets") else ()

    # %% events from the serving side (scheduler thread: enqueue only)

    def room_allocated(self, room: RoomId, pages: Any, n_tokens: int, snapshot: bool = True) -> None:
        """Decode allocated `pages` to the room and told prefill where to write: a journal
        event and, with `snapshot_on_allocation`, a digest of what the pages hold before
        the transfer writes them (one launch; its content goes to the diagnosis only).
        `snapshot=False`: the caller runs after prefill may have written (journal only).

        With the snapshot, the journal event is made on the collector when the snapshot
        comes back (the page ids copied to the host there, behind the snapshot's event),
        at the time read here. Without it, here, as before: the page ids' copy down with
        an event of its own (`host_ids.capture`), since nothing else orders it."""
        diagnosis = self.diagnosis
        if diagnosis is None:
            return
        t_ns = _monotonic_ns()
        key = room.key
        # the verdicts' digests come first: with the collector's queue half full, no snapshot
        # (the room is then diagnosed without its pages' earlier bytes)
        if snapshot and self.snapshot_on_allocation and len(self._queue) < self.engine.max_pending // 2:
            # contents only: the snapshot's fold and digests would never be read
            if self.engine.submit_room(key, pages, n_tokens, partial(self._on_before, key, pages, n_tokens, t_ns=t_ns),
                                       contents_only=True) is not None:
                return
        diagnosis.allocated(key, pages, at_ns=t_ns)

    def _on_before(self, key: str, pages: Any, n_tokens: int, batch: BatchResult, t_ns: int | None = None) -> None:
        """The allocation snapshot is back (collector thread): the journal's allocation
        event at `t_ns` (when the serving thread allocated; None: journalled already),
        then what the pages held before the transfer."""
        diagnosis = self.diagnosis
        if t_ns is not None:
            safe_invoke("decode.diagnosis_allocated", diagnosis.allocated, key, pages, at_ns=t_ns)
        contents = batch.contents
        if batch.error is None and contents and not (batch.out_of_range and batch.out_of_range[0]):
            safe_invoke("decode.diagnosis_before", diagnosis.before, key, pages, n_tokens, contents[0])

    def room_received(
        self, room: RoomId, pages: Any, n_tokens: int, inband: InbandDigest | None, extra: dict | None = None,
    ) -> PendingDigest | None:
        """Transfer complete: start tracking and digest at `decode_recv`.

        `extra` goes into every record of the room (held, not copied: the caller makes
        one per room); a ``rid`` key (SGLang's request id) becomes the records' ``rid``.
        """
        state = _Room(room, pages, n_tokens, inband, extra)
        key = state.key
        rooms = self._rooms
        with self._lock:
            earlier = rooms.pop(key, None)  # the same room again goes to the end: the newest, evicted last
            rooms[key] = state
            full = self.max_rooms is not None and len(rooms) > self.max_rooms
        if earlier is not None:  # moved again (a rebootstrap after a retraction no hook saw)
            self._retire(earlier, RECEIVED_AGAIN, "decode_step")
        if full:
            self._evict()
        # the room's digest: one launch (the same lines in `room_finished`)
        jobs = ((state, "decode_recv", None),)
        if _digest_observers:
            self._observe(jobs)
        t_ns = _monotonic_ns()
        try:
            pending = self.engine.submit_room(key, pages, n_tokens, partial(self._on_results, jobs, t_ns))
        except Exception:
            self._failed(jobs, t_ns)
            return None
        if pending is None:
            self._dropped(jobs, t_ns)
            return None
        try:
            state.table = pending.table
        except AttributeError:  # a stand-in engine's ticket
            pass
        state.tickets.append(pending)
        return pending

    def _evict(self) -> None:
        """The tracking table is over its bound: the oldest rooms go, recorded as `skipped`
        (on the collector, after their digests in flight)."""
        evicted = []
        with self._lock:
            while self.max_rooms is not None and len(self._rooms) > self.max_rooms:
                evicted.append(self._rooms.pop(next(iter(self._rooms))))
        if evicted:
            self.engine.post(self._on_evicted, evicted)

    def _on_evicted(self, evicted: list[_Room]) -> None:
        for old in evicted:
            if old.finished:  # its finish digest, submitted before this, gave its last verdict
                if self.diagnosis is not None:
                    safe_invoke("decode.diagnosis_retired", self.diagnosis.retired, old.key)
                continue
            if self.diagnosis is not None:
                safe_invoke("decode.diagnosis_forget", self.diagnosis.abandoned, old.key)
            self._publish(old.room, "decode_step", None, "skipped", "evicted: tracking table full", None, None, old)

    def room_finished(self, room: RoomId) -> PendingDigest | None:
        """Before the room's pages are released: last digest, then forget the room
        (a batch of one, for rooms that finish outside a decode batch)."""
        state = self._rooms.get(room.key)
        if state is None:
            return None
        state.finished = True
        jobs = ((state, "decode_finish", None),)  # as in `room_received`
        if _digest_observers:
            self._observe(jobs)
        t_ns = _monotonic_ns()
        try:
            pending = self.engine.submit_room(state.key, state.pages, state.n_tokens,
                                              partial(self._on_results, jobs, t_ns), table=state.table)
        except Exception:
            self._failed(jobs, t_ns)
            return None
        if pending is None:
            self._dropped(jobs, t_ns)
            return None
        state.tickets.append(pending)
        return pending

    def step_due(self, batch_index: int) -> bool:
        """Whether decode batch number `batch_index` (counted from 1) is a `decode_step`
        point: every `step_interval` batches, every room in that batch at once."""
        return self.step_interval > 0 and batch_index > 0 and batch_index % self.step_interval == 0

    def batch_done(self, finished: Sequence[RoomId], stepped: Sequence[tuple[RoomId, int]]) -> PendingDigest | None:
        """One decode batch in one launch: `decode_finish` for the rooms that finished in
        it, `decode_step` for `stepped` (room, its step count), which the caller passes
        on batches where `step_due` says so. A batch of 64 rooms costs one enqueue.

        Per room, the serving thread looks the room up and hands it the batch's ticket,
        and the engine copies its room-table row as the receipt found its page table
        (`launch._known_tables`); the batch's (room, stage, step) jobs are made on the
        collector (`_batch_jobs`). `stepped` is held, not copied (the caller makes one
        per batch)."""
        rooms = self._rooms
        done: list[_Room] = []
        for room in finished:
            state = rooms.get(room.key)
            if state is not None:
                state.finished = True
                done.append(state)
        states: list = []
        for room, _ in stepped:
            states.append(rooms.get(room.key))
        if None in states:  # rooms no longer tracked (retired since): left out
            kept = [(state, pair) for state, pair in zip(states, stepped) if state is not None]
            states, stepped = [state for state, _ in kept], [pair for _, pair in kept]
        if done:
            states = done + states
        if not states:
            return None
        if _digest_observers:
            self._observe(_batch_jobs(states, len(done), stepped))
        t_ns = _monotonic_ns()
        try:
            pending = self.engine.submit(states, partial(self._on_batch, states, len(done), stepped, t_ns))
        except Exception:
            self._failed(_batch_jobs(states, len(done), stepped), t_ns)
            return None
        if pending is None:
            self._dropped(_batch_jobs(states, len(done), stepped), t_ns)
            return None
        for state in states:
            state.tickets.append(pending)
        return pending

    def _on_batch(self, states: list, n_finished: int, stepped: Sequence, t_ns: int, batch: BatchResult) -> None:
        """A `batch_done` batch's results (collector thread): its jobs, then `_on_results`."""
        self._on_results(_batch_jobs(states, n_finished, stepped), t_ns, batch)

    def room_skipped(self, room: RoomId, reason: str, stage: str = "decode_recv", extra: dict | None = None,
                     n_tokens: int | None = None) -> None:
        """Aborted, retracted or health-check rooms: record `skipped` and forget them.

        The record keeps the room's extras (its rid) if it was tracked; `extra`
        names them for a room that never was. A digest of the room still in
        flight read pages that are freed now and may be reused before it ran:
        its result is recorded as skipped too. What the kernels had run is read
        here; the record, the journal and the diagnosis follow on the collector.
        `n_tokens`: the room's length where it was never tracked (its coverage bytes).
        """
        with self._lock:
            state = self._rooms.pop(room.key, None)
        if state is None:
            self.engine.post(self._on_skipped, (room, stage, reason, None, extra or None, _monotonic_ns(), n_tokens))
        else:
            self._retire(state, reason, stage, extra)

    def _retire(self, state: _Room, reason: str, stage: str, extra: dict | None = None) -> None:
        """A tracked room no longer in the table is recorded `skipped` (`room_skipped`)."""
        t_ns = _monotonic_ns()
        state.retired = reason
        state.unsafe = {pending for pending in list(state.tickets) if not pending.ready()}
        extras = {**state.extra, **(extra or {})}
        self.engine.post(self._on_skipped, (state.room, stage, reason, state, extras or None, t_ns, None))

    def _on_skipped(self, args: tuple) -> None:
        room, stage, reason, state, extras, t_ns, n_tokens = args
        diagnosis = self.diagnosis
        if diagnosis is not None:
            if state is not None:
                safe_invoke("decode.diagnosis_freed", diagnosis.freed, room.key, state.pages, at_ns=t_ns)
            safe_invoke("decode.diagnosis_forget", diagnosis.abandoned, room.key)
        self._publish(room, stage, None, "skipped", reason, None, None, state, extra=extras)
        if state is None:  # never tracked: its bytes counted here, from its length
            safe_invoke("decode.coverage", self._cover_untracked, reason, n_tokens)

    def tracked(self) -> int:
        with self._lock:
            return len(self._rooms)

    def holds(self, room: RoomId) -> bool:
        """Whether the monitor took `room` (its receipt) and has not let it go."""
        with self._lock:
            return room.key in self._rooms

    def _get(self, room: RoomId) -> _Room | None:
        return self._rooms.get(room.key)

    def _observe(self, jobs) -> None:
        points = [(state.room, stage, step) for state, stage, step in jobs]
        for observer in list(_digest_observers):
            safe_invoke("decode.digest_observer", observer, points)

    def _failed(self, jobs, t_ns: int) -> None:
        """The digests' launch raised (a device or launcher error): counted as the probe's
        error, and the rooms as a full queue leaves them: skipped (`probe_error`), finished
        ones forgotten and counted, never left in the table for an eviction to pass over."""
        record_error("decode.digest_submit")
        self._dropped(jobs, t_ns, "probe_error")

    def _dropped(self, jobs, t_ns: int, reason: str = "queue_full") -> None:
        """The digests are lost: the digest queue was full (counted), or their launch
        failed (`_failed`). Rooms that finished in them are forgotten on the collector,
        their pages journalled as freed."""
        if self.metrics is not None and reason == "queue_full":
            self.metrics.records_dropped.labels(sink="digest_queue").inc(len(jobs))
        with self._coverage_lock:
            for state, _, _ in jobs:
                _coverage_of(state).fold("skipped", reason)
        finished = [state for state, stage, _ in jobs if stage == "decode_finish"]
        if finished:
            self.engine.post(self._on_lost, (finished, t_ns))

    def _on_lost(self, args: tuple) -> None:
        finished, t_ns = args
        for state in finished:
            if self.diagnosis is not None:
                safe_invoke("decode.diagnosis_freed", self.diagnosis.freed, state.key, state.pages, at_ns=t_ns + 1)
            self._forget_if_done(state, "decode_finish")
            safe_invoke("decode.coverage", _coverage_of(state).count, self.metrics,
                        estimated_bytes(self.engine, state.n_tokens))

    # %% digest results (collector thread)

    def _on_results(self, jobs: Sequence[tuple[_Room, str, int | None]], t_ns: int, batch: BatchResult) -> None:
        """A batch's results (collector thread): the journal events the serving thread
        saw with it, then each room judged, one at a time."""
        ticket = batch.ticket
        diagnosis = self.diagnosis
        for state, stage, _ in jobs:
            try:
                state.tickets.remove(ticket)  # back: no longer a digest a retirement must look at
            except ValueError:
                pass
            if diagnosis is not None and stage != "decode_step":
                if stage == "decode_recv":  # the transfer had landed when its digest was enqueued
                    safe_invoke("decode.diagnosis_landed", diagnosis.landed, state.key, state.pages, at_ns=t_ns)
                else:  # freed right after its finish digest was enqueued
                    safe_invoke("decode.diagnosis_freed", diagnosis.freed, state.key, state.pages, at_ns=t_ns + 1)
        if batch.error is not None:
            for state, stage, step in jobs:
                safe_invoke("decode.on_failure", self._on_failure, state, stage, step, batch.error)
            return
        if self.metrics is not None and batch.gpu_seconds is not None:
            self.metrics.digest_gpu_seconds.labels(stage=jobs[0][1]).observe(batch.gpu_seconds)
        enqueued = t_ns / 1e9  # time.monotonic's clock
        enqueued_ns = t_ns if diagnosis is not None else None
        contents = batch.contents
        for i, (state, stage, step) in enumerate(jobs):
            if i:
                yield_to_serving()  # a batch's rooms one at a time, never holding the GIL for all of them
            room_bytes = batch.room_bytes[i] if i < len(batch.room_bytes) else None
            outside = batch.out_of_range[i] if i < len(batch.out_of_range) else 0
            if outside:  # the probe's page list named rows past a buffer: nothing to judge
                self._forget_if_done(state, stage)
                self._publish(state.room, stage, step, "not_comparable",
                              f"{outside} page rows outside the index-K buffers (not read)", None, None, state)
                continue
            if state.unsafe and ticket in state.unsafe:
                # the room was retired before this digest ran: its pages may hold another room's bytes
                self._publish(state.room, stage, step, "skipped", f"{state.retired} before this digest ran",
                              None, None, state)
                continue
            content = contents[i] if enqueued_ns is not None and i < len(contents) else None
            judged = safe_invoke("decode.on_result", self._on_result, state, stage, step, enqueued, batch.digests[i],
                                 room_bytes, content, enqueued_ns, fallback=_NOT_JUDGED)
            if judged is _NOT_JUDGED:  # a probe failure while judging: the stage is still recorded, the room
                # forgotten with its last digest and counted (else it stayed in the table, passed over when
                # evicted as finished: its bytes counted nowhere)
                safe_invoke("decode.on_result_failed", self._on_failure, state, stage, step, "probe error while judging")

    def _on_result(self, state: _Room, stage: str, step: int | None, enqueued: float, digest: RoomDigest,
                   room_bytes: int | None, content=None, enqueued_ns: int | None = None) -> None:
        verdict, reason, comparison = self._judge(state, digest)
        first = verdict == "mismatch" and state.first_divergence is None
        if first:
            state.first_divergence = stage
            if self.metrics is not None:
                self.metrics.first_divergence.labels(stage=stage).inc()
        diagnosis = page_events = None
        if content is not None:
            found = safe_invoke("decode.diagnose", self.diagnosis.observe, state.room.key, state.pages,
                                state.n_tokens, enqueued_ns, content, verdict, comparison)
            if found is not None:
                diagnosis, page_events = found
            if first and diagnosis and self.metrics is not None:
                for cell in diagnosis:
                    self.metrics.diagnoses.labels(stage=stage, kind=cell["kind"]).inc()
        self._forget_if_done(state, stage)  # first: whoever reads the record finds the room forgotten
        self._publish(state.room, stage, step, verdict, reason, digest, comparison, state, room_bytes, enqueued,
                      diagnosis=diagnosis, page_events=page_events)

    def _on_failure(self, state: _Room, stage: str, step: int | None, error: str) -> None:
        """The digest of this stage could not be taken: say so, and stop waiting for it."""
        self._forget_if_done(state, stage)
        self._publish(state.room, stage, step, "skipped", f"digest failed: {error}", None, None, state)

    def _forget_if_done(self, state: _Room, stage: str) -> None:
        """A finished room is forgotten with its finish digest's result: that digest is the
        room's last, and the collector delivers a room's digests in the order they were
        submitted, so none of its results is still to come."""
        if stage != "decode_finish" or not state.finished:
            return
        key = state.key
        with self._lock:
            done = self._rooms.get(key) is state
            if done:
                del self._rooms[key]
        if done and self.diagnosis is not None:
            self.diagnosis.retired(key)  # its content is now its pages' last occupant's

    def _judge(self, state: _Room, digest: RoomDigest) -> tuple[str, str, Comparison | None]:
        """Verdict against the best prefill evidence we have."""
        inband = state.inband
        if inband is not None and inband.signature != digest.signature:
            return "not_comparable", "layout signature differs from prefill's", None
        if inband is not None and inband.n_tokens != digest.n_tokens:
            return "not_comparable", f"prefill digested {inband.n_tokens} tokens, decode {digest.n_tokens}", None
        room_value = digest.room if inband is not None else None  # a sum over the matrix: once
        need_vectors = self.fetch_always or inband is None or inband.room_digest != room_value
        if need_vectors and state.expected is None and state.fetches < MAX_FETCHES_PER_ROOM:
            state.expected = self._fetch(state.room)
            state.fetches += state.expected is None
        if state.expected is not None:
            comparison = compare(state.expected, digest)
            return comparison.verdict, comparison.reason, comparison
        if inband is None:
            return "unverified", "no prefill digest (none in band, none from the exchange)", None
        if inband.room_digest == room_value:
            return "match", "", None
        return "mismatch", "room digest differs; vectors unavailable, not localised", None

    def _fetch(self, room: RoomId) -> RoomDigest | None:
        if self.fetch_vectors is None:
            return None
        try:
            return self.fetch_vectors(room.key)
        except Exception:
            record_error("decode.fetch_vectors")
            if self.metrics is not None:
                self.metrics.exchange_errors.labels(kind="fetch").inc()
            return None

    @staticmethod
    def _digest_record(state: _Room | None, digest: RoomDigest | None) -> dict | None:
        """`digest.to_record()`, kept per room: a room's digests at its receipt, steps and
        finish are nearly always the same bytes, and their hex strings and lists are most of
        a record's cost on the collector. Each record gets a dict of its own; the lists
        inside are shared with the room's earlier records (written, never changed)."""
        if digest is None or state is None:
            return None
        key = (digest.key, digest.signature, digest.n_tokens, digest.layer_ids, digest.segments,
               digest.layer_segment.tobytes(), digest.pages.tobytes())
        kept = state.digest_record
        if kept is not None and kept[0] == key:
            return dict(kept[1])
        record = digest.to_record()
        state.digest_record = (key, record)
        return dict(record)

    def _publish(self, room, stage, step, verdict, reason, digest, comparison, state=None, room_bytes=None, enqueued=None,
                 extra=None, diagnosis=None, page_events=None):
        record = room_record(
            role="decode", stage=stage, room=room.room, attempt=room.attempt, digest=digest,
            layout=self.engine.layout.name, step=step, verdict=verdict, reason=reason,
            expected_room=state.inband.room_digest if state is not None and state.inband is not None else None,
            comparison=comparison,
            first_divergence=state.first_divergence if state is not None else None,
            extra=extra if extra is not None else (state.extra if state is not None and state.extra else None),
            tokens=state.n_tokens if state is not None else None,
            diagnosis=diagnosis, page_events=page_events, digest_record=self._digest_record(state, digest),
        )
        # counted before the record goes out: whoever sees a record sees its counts
        if state is not None:
            safe_invoke("decode.coverage", self._cover, state, verdict, reason, digest, room_bytes)
        if self.on_verdict is not None:
            safe_invoke("decode.on_verdict", self.on_verdict, room, stage, verdict, comparison)
        if self.metrics is not None:
            safe_invoke("decode.metrics", self._count, stage, verdict, comparison, room_bytes, enqueued)
        safe_invoke("decode.emit", self.emit, record)

    def _count(self, stage, verdict, comparison, room_bytes, enqueued) -> None:
        """A published verdict's metrics."""
        m = self.metrics
        if room_bytes is not None and enqueued is not None:  # every digest's result
            verified, digested, digest_bytes, latency = self._digest_metrics(stage, verdict)
            verified(1)
            digested(1)
            digest_bytes(room_bytes)
            latency(time.monotonic() - enqueued)
        else:
            m.rooms_verified.labels(stage=stage, verdict=verdict).inc()
            if room_bytes is not None:
                m.rooms_digested.labels(stage=stage).inc()
                m.digest_bytes.labels(stage=stage).inc(room_bytes)
            if enqueued is not None:
                m.verify_latency_seconds.labels(stage=stage).observe(time.monotonic() - enqueued)
        if verdict == "mismatch" and comparison is None:  # found bad, vectors unavailable: not localised
            m.mismatch_unlocalised.labels(stage=stage).inc()
        if comparison is not None and comparison.verdict == "mismatch":
            m.observe_localisation(stage, comparison.layers, comparison.pages)
            for segment in comparison.segments:
                per_segment = sum(1 for _, s in comparison.layer_segments if s == segment)
                m.mismatch_cells.labels(stage=stage, segment=segment).inc(per_segment * len(comparison.pages))

    def _digest_metrics(self, stage: str, verdict: str) -> tuple:
        """What a digest's result counts (rooms verified with its verdict, rooms digested,
        bytes, latency), looked up once per (stage, verdict): four `labels` calls and the
        client's checks per record otherwise (`counter_add`)."""
        key = (stage, verdict)
        children = self._digest_metric_children.get(key)
        if children is None:
            m = self.metrics
            children = (counter_add(m.rooms_verified.labels(stage=stage, verdict=verdict)),
                        counter_add(m.rooms_digested.labels(stage=stage)),
                        counter_add(m.digest_bytes.labels(stage=stage)),
                        m.verify_latency_seconds.labels(stage=stage).observe)
            self._digest_metric_children[key] = children
        return children

    # %% coverage (collector thread; docs/coverage.md)

    def _cover(self, state: _Room, verdict: str, reason: str, digest: RoomDigest | None, room_bytes: int | None) -> None:
        """Fold one stage's outcome into its room; count the room once it is no longer tracked."""
        outcome = outcome_of(verdict)
        if verdict == "skipped":
            why = skip_reason(reason)
            if why is None:
                return
        elif verdict == "not_comparable" and digest is None:
            why = "probe_error"  # the probe's page list named rows outside the buffers
        else:
            why = judged_reason(verdict, state.inband, state.expected, digest,
                                self._stage_signatures() if verdict == "not_comparable" else ())
        if outcome == "unverified" and state.extra and state.extra.get("unverified_reason"):
            why = str(state.extra["unverified_reason"])  # the hook knew why (sglang/pd_decode: metadata_on_device)
        with self._coverage_lock:
            coverage = _coverage_of(state)
            coverage.fold(outcome, why, room_bytes)
        if self._rooms.get(state.key) is not state:
            coverage.count(self.metrics, estimated_bytes(self.engine, state.n_tokens))

    def _stage_signatures(self) -> frozenset[int]:
        signatures = getattr(self, "_pp_signatures", None)
        if signatures is None:
            try:
                signatures = stage_signatures(self.engine.layout, self.engine.layer_ids)
            except Exception:  # a stand-in engine without a layout: no stage to recognise
                signatures = frozenset()
            self._pp_signatures = signatures
        return signatures

    def _cover_untracked(self, reason: str, n_tokens: int | None) -> None:
        why = skip_reason(reason)
        if why is None or self.metrics is None:
            return
        coverage = RoomCoverage()
        coverage.fold("skipped", why)
        coverage.count(self.metrics, estimated_bytes(self.engine, n_tokens))


def _batch_jobs(states: list, n_finished: int, stepped: Sequence) -> list[tuple[_Room, str, int | None]]:
    """A `batch_done` batch's (room, stage, step) jobs, in its launch's order: its first
    `n_finished` rooms finished, the rest stepped, with the step counts of `stepped`."""
    jobs: list[tuple[_Room, str, int | None]] = [(state, "decode_finish", None) for state in states[:n_finished]]
    jobs += [(state, "decode_step", pair[1]) for state, pair in zip(states[n_finished:], stepped)]
    return jobs


def _coverage_of(state: _Room) -> RoomCoverage:
    coverage = state.coverage
    if coverage is None:
        coverage = state.coverage = RoomCoverage()
    return coverage
