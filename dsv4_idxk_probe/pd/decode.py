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
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..background import yield_to_serving
from ..digest.engine import BatchResult, DigestEngine, PendingDigest
from ..digest.result import Comparison, RoomDigest, compare
from ..digest.room_table import RoomRequest
from ..metrics.definitions import ProbeMetrics
from ..safety import record_error, safe_invoke
from .inband import InbandDigest
from .records import room_record
from .rooms import RoomId

Emit = Callable[[dict], Any]
FetchVectors = Callable[[str], "RoomDigest | None"]
# A room whose prefill vectors could not be fetched (prefill busy, not yet published) asks
# again at its next digests, this many times in all: one slow answer must not cost a room its
# localisation for life, nor a dead peer a fetch per digest.
MAX_FETCHES_PER_ROOM = 3


@dataclass
class _Room:
    room: RoomId
    pages: Any
    n_tokens: int
    inband: InbandDigest | None
    expected: RoomDigest | None = None  # full prefill digest, once fetched
    fetches: int = 0  # fetches of it that failed (each later digest of the room may try again)
    first_divergence: str | None = None
    finished: bool = False
    retired: str | None = None  # why the room stopped being tracked (retraction, abort)
    unsafe: set = field(default_factory=set)  # ids of its digests not yet run when it was retired
    pending: dict = field(default_factory=dict)  # id -> its digests submitted whose results have not come back
    in_flight: int = 0
    extra: dict = field(default_factory=dict)


class DecodeMonitor:
    """Tracks received rooms and turns decode-side digests into verdicts."""

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

    # %% events from the serving side (scheduler thread: enqueue only)

    def room_allocated(self, room: RoomId, pages: Any, n_tokens: int, snapshot: bool = True) -> None:
        """Decode allocated `pages` to the room and told prefill where to write: a journal
        event and, with `snapshot_on_allocation`, a digest of what the pages hold before
        the transfer writes them (one launch; its content goes to the diagnosis only).
        `snapshot=False`: the caller runs after prefill may have written (journal only)."""
        diagnosis = self.diagnosis
        if diagnosis is None:
            return
        key = room.key
        # the page ids' copy down rides on the snapshot's batch event, queued right behind it
        copy = diagnosis.allocated(key, pages, deferred=True)
        ticket = None
        try:
            # the verdicts' digests come first: with the collector's queue half full, no snapshot
            # (the room is then diagnosed without its pages' earlier bytes)
            if snapshot and self.snapshot_on_allocation and self.engine.backlog() < self.engine.max_pending // 2:
                # contents only: the snapshot's fold and digests would never be read
                ticket = self.engine.submit(
                    [RoomRequest(key, pages, n_tokens)],
                    lambda batch: safe_invoke("decode.diagnosis_before", self._on_before, key, pages, n_tokens, batch),
                    contents_only=True)
        finally:
            if copy is not None:  # the batch's event orders the copy only on the same device's stream
                rides = ticket is not None and ticket.error is None and getattr(pages, "device", None) == self.engine.device
                copy.settle(ticket.done if rides else None)

    def _on_before(self, key: str, pages: Any, n_tokens: int, batch: BatchResult) -> None:
        contents = getattr(batch, "contents", ())
        if batch.error is None and contents and not (batch.out_of_range and batch.out_of_range[0]):
            self.diagnosis.before(key, pages, n_tokens, contents[0])

    def room_received(
        self, room: RoomId, pages: Any, n_tokens: int, inband: InbandDigest | None, extra: dict | None = None,
    ) -> PendingDigest | None:
        """Transfer complete: start tracking and digest at `decode_recv`.

        `extra` goes into every record of the room; a ``rid`` key (SGLang's
        request id) becomes the records' ``rid``.
        """
        state = _Room(room, pages, n_tokens, inband, extra=dict(extra or {}))
        if self.diagnosis is not None:
            self.diagnosis.landed(room.key, pages)
        evicted = []
        with self._lock:
            self._rooms.pop(room.key, None)
            self._rooms[room.key] = state
            while self.max_rooms is not None and len(self._rooms) > self.max_rooms:
                evicted.append(self._rooms.pop(next(iter(self._rooms))))
        for old in evicted:
            if self.diagnosis is not None:
                safe_invoke("decode.diagnosis_forget", self.diagnosis.abandoned, old.room.key)
            self._publish(old.room, "decode_step", None, "skipped", "evicted: tracking table full", None, None, old)
        return self._submit_jobs([(state, "decode_recv", None)])

    def room_finished(self, room: RoomId) -> PendingDigest | None:
        """Before the room's pages are released: last digest, then forget the room
        (a batch of one, for rooms that finish outside a decode batch)."""
        return self.batch_done([room], [])

    def step_due(self, batch_index: int) -> bool:
        """Whether decode batch number `batch_index` (counted from 1) is a `decode_step`
        point: every `step_interval` batches, every room in that batch at once."""
        return self.step_interval > 0 and batch_index > 0 and batch_index % self.step_interval == 0

    def batch_done(self, finished: Sequence[RoomId], stepped: Sequence[tuple[RoomId, int]]) -> PendingDigest | None:
        """One decode batch in one launch: `decode_finish` for the rooms that finished in
        it, `decode_step` for `stepped` (room, its step count), which the caller passes
        on batches where `step_due` says so. A batch of 64 rooms costs one enqueue."""
        jobs: list[tuple[_Room, str, int | None]] = []
        for room in finished:
            state = self._get(room)
            if state is not None:
                state.finished = True
                jobs.append((state, "decode_finish", None))
        for room, step in stepped:
            state = self._get(room)
            if state is not None:
                jobs.append((state, "decode_step", step))
        if not jobs:
            return None
        pending = self._submit_jobs(jobs)
        if self.diagnosis is not None:  # after their last digest: the pages are freed now
            for state, stage, _ in jobs:
                if stage == "decode_finish":
                    self.diagnosis.freed(state.room.key, state.pages)
        return pending

    def room_skipped(self, room: RoomId, reason: str, stage: str = "decode_recv", extra: dict | None = None) -> None:
        """Aborted, retracted or health-check rooms: record `skipped` and forget them.

        The record keeps the room's extras (its rid) if it was tracked; `extra`
        names them for a room that never was. A digest of the room still in
        flight read pages that are freed now and may be reused before it ran:
        its result is recorded as skipped too.
        """
        with self._lock:
            state = self._rooms.pop(room.key, None)
            if state is not None:
                state.retired = reason
                state.unsafe = {key for key, p in state.pending.items() if not p.ready()}
        extras = {**(state.extra if state is not None else {}), **(extra or {})}
        if self.diagnosis is not None:
            if state is not None:
                self.diagnosis.freed(room.key, state.pages)
            safe_invoke("decode.diagnosis_forget", self.diagnosis.abandoned, room.key)
        self._publish(room, stage, None, "skipped", reason, None, None, state, extra=extras or None)

    def tracked(self) -> int:
        with self._lock:
            return len(self._rooms)

    # %% digest results (collector thread)

    def _get(self, room: RoomId) -> _Room | None:
        with self._lock:
            return self._rooms.get(room.key)

    def _count_in_flight(self, jobs: list[tuple[_Room, str, int | None]], delta: int) -> None:
        """Digests outstanding per room; the serving and collector threads both change them."""
        with self._lock:
            for state, _, _ in jobs:
                state.in_flight += delta

    def _submit_jobs(self, jobs: list[tuple[_Room, str, int | None]]) -> PendingDigest | None:
        self._count_in_flight(jobs, +1)
        enqueued = time.monotonic()
        enqueued_ns = time.monotonic_ns() if self.diagnosis is not None else None
        requests = [RoomRequest(state.room.key, state.pages, state.n_tokens) for state, _, _ in jobs]
        holder: list = []  # the batch's PendingDigest, for results of rooms retired meanwhile
        pending = self.engine.submit(requests, lambda batch: self._on_results(jobs, enqueued, batch, holder, enqueued_ns))
        if pending is None:
            self._count_in_flight(jobs, -1)
            if self.metrics is not None:
                self.metrics.records_dropped.labels(sink="digest_queue").inc(len(jobs))
            return None
        holder.append(pending)
        if not pending.ready():  # one query per batch; a batch digested at submit (host buffers) is done
            with self._lock:
                for state, _, _ in jobs:
                    state.pending[id(pending)] = pending
        return pending

    def _on_results(self, jobs: list[tuple[_Room, str, int | None]], enqueued: float, batch: BatchResult,
                    holder: list | None = None, enqueued_ns: int | None = None) -> None:
        batch_id = id(holder[0]) if holder else None
        with self._lock:  # results are back: no longer a digest a retirement must wait for
            for state, _, _ in jobs:
                state.pending.pop(batch_id, None)
        if batch.error is not None:
            for state, stage, step in jobs:
                safe_invoke("decode.on_failure", self._on_failure, state, stage, step, batch.error)
            return
        if self.metrics is not None and batch.gpu_seconds is not None:
            self.metrics.digest_gpu_seconds.labels(stage=jobs[0][1]).observe(batch.gpu_seconds)
        for i, (state, stage, step) in enumerate(jobs):
            if i:
                yield_to_serving()  # a batch's rooms one at a time, never holding the GIL for all of them
            room_bytes = batch.room_bytes[i] if i < len(batch.room_bytes) else None
            outside = batch.out_of_range[i] if i < len(getattr(batch, "out_of_range", ())) else 0
            if outside:  # the probe's page list named rows past a buffer: nothing to judge
                self._count_in_flight([(state, stage, step)], -1)
                self._forget_if_done(state)
                self._publish(state.room, stage, step, "not_comparable",
                              f"{outside} page rows outside the index-K buffers (not read)", None, None, state)
                continue
            if batch_id is not None and batch_id in state.unsafe:
                # the room was retired before this digest ran: its pages may hold another room's bytes
                self._count_in_flight([(state, stage, step)], -1)
                self._publish(state.room, stage, step, "skipped", f"{state.retired} before this digest ran",
                              None, None, state)
                continue
            contents = getattr(batch, "contents", ())
            content = contents[i] if enqueued_ns is not None and i < len(contents) else None
            safe_invoke("decode.on_result", self._on_result, state, stage, step, enqueued, batch.digests[i], room_bytes,
                        content, enqueued_ns)

    def _on_result(self, state: _Room, stage: str, step: int | None, enqueued: float, digest: RoomDigest,
                   room_bytes: int | None, content=None, enqueued_ns: int | None = None) -> None:
        self._count_in_flight([(state, stage, step)], -1)
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
        self._forget_if_done(state)  # first: whoever reads the record finds the room forgotten
        self._publish(state.room, stage, step, verdict, reason, digest, comparison, state, room_bytes, enqueued,
                      diagnosis=diagnosis, page_events=page_events)

    def _on_failure(self, state: _Room, stage: str, step: int | None, error: str) -> None:
        """The digest of this stage could not be taken: say so, and stop waiting for it."""
        self._count_in_flight([(state, stage, step)], -1)
        self._forget_if_done(state)
        self._publish(state.room, stage, step, "skipped", f"digest failed: {error}", None, None, state)

    def _forget_if_done(self, state: _Room) -> None:
        with self._lock:
            done = state.finished and state.in_flight <= 0 and self._rooms.get(state.room.key) is state
            if done:
                del self._rooms[state.room.key]
        if done and self.diagnosis is not None:
            self.diagnosis.retired(state.room.key)  # its content is now its pages' last occupant's

    def _judge(self, state: _Room, digest: RoomDigest) -> tuple[str, str, Comparison | None]:
        """Verdict against the best prefill evidence we have."""
        inband = state.inband
        if inband is not None and inband.signature != digest.signature:
            return "not_comparable", "layout signature differs from prefill's", None
        if inband is not None and inband.n_tokens != digest.n_tokens:
            return "not_comparable", f"prefill digested {inband.n_tokens} tokens, decode {digest.n_tokens}", None
        need_vectors = self.fetch_always or inband is None or inband.room_digest != digest.room
        if need_vectors and state.expected is None and state.fetches < MAX_FETCHES_PER_ROOM:
            state.expected = self._fetch(state.room)
            state.fetches += state.expected is None
        if state.expected is not None:
            comparison = compare(state.expected, digest)
            return comparison.verdict, comparison.reason, comparison
        if inband is None:
            return "unverified", "no prefill digest (none in band, none from the exchange)", None
        if inband.room_digest == digest.room:
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
            diagnosis=diagnosis, page_events=page_events,
        )
        safe_invoke("decode.emit", self.emit, record)
        if self.on_verdict is not None:
            safe_invoke("decode.on_verdict", self.on_verdict, room, stage, verdict, comparison)
        m = self.metrics
        if m is None:
            return
        m.rooms_verified.labels(stage=stage, verdict=verdict).inc()
        if room_bytes is not None:
            m.rooms_digested.labels(stage=stage).inc()
            m.digest_bytes.labels(stage=stage).inc(room_bytes)
        if enqueued is not None:
            m.verify_latency_seconds.labels(stage=stage).observe(time.monotonic() - enqueued)
        if comparison is not None and comparison.verdict == "mismatch":
            m.observe_localisation(stage, comparison.layers, comparison.pages)
            for segment in comparison.segments:
                per_segment = sum(1 for _, s in comparison.layer_segments if s == segment)
                m.mismatch_cells.labels(stage=stage, segment=segment).inc(per_segment * len(comparison.pages))
