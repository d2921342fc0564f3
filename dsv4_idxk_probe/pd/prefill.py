"""Prefill side: digest each room as its last chunk leaves, and keep its vectors.

The room digest goes in band (`InbandDigest`, read from the returned
`PendingDigest` once the stream is past the kernel); the (layer, segment)
matrix and page vector, needed only to localise, stay in a bounded table
that the exchange serves to decode, and go to the room log.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from functools import partial
from typing import Any, Callable, Sequence

from ..digest.engine import BatchResult, DigestEngine, PendingDigest
from ..digest.result import RoomDigest
from ..digest.room_table import RoomRequest
from ..metrics.definitions import ProbeMetrics, counter_add
from ..safety import safe_invoke
from .records import room_record
from .rooms import RoomId

Emit = Callable[[dict], Any]


class RecentRooms:
    """Bounded LRU of recent room digests, shared by the collector and the exchange threads.

    A room sent again (a rebootstrap resends the same room id) is marked at its send, on the
    serving thread (`sending`): from then on the room's earlier digest no longer answers for
    it, and only the digest of that latest send does, once the collector puts it. Decode asks
    after the new transfer landed, so after the mark: it gets "not found" (and asks again)
    until the new digest is in, never the earlier transfer's, whose bytes may differ."""

    def __init__(self, capacity: int):
        self.capacity = max(1, int(capacity))
        self._items: OrderedDict[str, RoomDigest] = OrderedDict()
        self._sending: OrderedDict[str, int] = OrderedDict()  # key -> its latest send, digest not in yet
        self._sends = 0
        self._lock = threading.Lock()
        self.evicted = 0

    def sending(self, key: str) -> int:
        """A send of `key` is being digested: the number `put` and `unsent` name it by."""
        with self._lock:
            self._sends += 1
            self._items.pop(key, None)  # an earlier transfer's digest: no answer for this one
            self._sending[key] = self._sends  # in flight: a few (each goes at its put), so never reordered
            if len(self._sending) > self.capacity:  # digests that never came (a failed batch)
                self._sending.popitem(last=False)
            return self._sends

    def unsent(self, key: str, send: int) -> None:
        """The send's digest will not come (not submitted): the room has no answer."""
        with self._lock:
            if self._sending.get(key) == send:
                del self._sending[key]

    def put(self, digest: RoomDigest, send: int | None = None) -> None:
        """Keep `digest`; of send `send` (`sending`), kept only if no later send of its room
        was marked since (the collector is behind: the later one's digest answers)."""
        key = digest.key
        with self._lock:
            latest = self._sending.get(key)
            if latest is not None and send is not None:
                if send != latest:
                    return
                del self._sending[key]
            self._items[key] = digest
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
                self.evicted += 1

    def get(self, key: str) -> RoomDigest | None:
        with self._lock:
            return self._items.get(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class PrefillMonitor:
    """Digests rooms at `prefill_send`; results are logged and kept for the exchange.

    On the serving thread a send is its digest's launch and nothing else: the room's
    extras (its rid) ride with the batch's callback to the collector, which writes the
    record, fills the exchange's table and counts the metrics."""

    def __init__(
        self,
        engine: DigestEngine,
        emit: Emit,
        metrics: ProbeMetrics | None = None,
        table_size: int = 4096,
    ):
        self.engine = engine
        self.emit = emit
        self.metrics = metrics
        self.table = RecentRooms(table_size)  # this monitor's digests, marked at each send
        self.recent = self.table  # what the exchange asks (a side routes further pools' keys beside it)
        self._sent_metrics: tuple | None = None  # `_send_counters`, made at the first batch

    def rooms_sent(self, rooms: Sequence[tuple[RoomId, Any, int]],
                   extras: Sequence[dict | None] | None = None) -> PendingDigest | None:
        """Digest rooms whose last chunk is being sent: (room id, pages, tokens) each.

        `pages` are the room's physical pages from the first transferred page
        (after any decode-side prefix), `tokens` the tokens they hold.
        `extras` (one per room, or None) go into the room's record; a ``rid``
        key becomes the record's ``rid``.
        """
        requests = [RoomRequest(rid.key, pages, n_tokens) for rid, pages, n_tokens in rooms]
        sends = tuple(self.table.sending(r.key) for r in requests)
        pending = None
        try:
            # The send path asks ready() right after NIXL's sync, to fill the in-band slot:
            # the batch's event is recorded right behind the kernel, so that works.
            pending = self.engine.submit(requests, partial(self._on_result, tuple(extras) if extras else None, sends))
        finally:
            if pending is None:  # a full queue, or the submit raised: no digest of these sends comes
                for request, send in zip(requests, sends):
                    self.table.unsent(request.key, send)
        return pending

    def room_sent(self, room: RoomId, pages: Any, n_tokens: int, extra: dict | None = None) -> PendingDigest | None:
        """`rooms_sent` of one room: one launch, no request object, no table."""
        key = room.key
        send = self.table.sending(key)
        pending = None
        try:
            pending = self.engine.submit_room(key, pages, n_tokens,
                                              partial(self._on_result, (extra,) if extra else None, (send,)))
        finally:
            if pending is None:
                self.table.unsent(key, send)
        return pending

    def lookup(self, key: str) -> RoomDigest | None:
        """The full digest of a recent room, for the exchange; None once evicted."""
        return self.recent.get(key)

    def _send_counters(self) -> tuple:
        """Rooms digested and bytes at `prefill_send`, looked up once: two `labels` calls
        and the client's per-call checks per batch otherwise (`counter_add`)."""
        if self._sent_metrics is None:
            m = self.metrics
            self._sent_metrics = (counter_add(m.rooms_digested.labels(stage="prefill_send")),
                                  counter_add(m.digest_bytes.labels(stage="prefill_send")))
        return self._sent_metrics

    def _on_result(self, extras: Sequence[dict | None] | None, sends: Sequence[int], batch: BatchResult) -> None:
        """A batch's digests (collector thread): counted, kept for the exchange, recorded with
        each room's extras (counted first: whoever sees a record sees its counts)."""
        digests = batch.digests
        if extras is None:
            extras = (None,) * len(digests)
        if self.metrics is not None:
            rooms_digested, digest_bytes = self._send_counters()
            rooms_digested(len(digests))
            digest_bytes(batch.bytes_digested)
            if batch.gpu_seconds is not None:
                self.metrics.digest_gpu_seconds.labels(stage="prefill_send").observe(batch.gpu_seconds)
        for digest, extra, send in zip(digests, extras, sends):
            self.table.put(digest, send)
            room = RoomId.from_key(digest.key)
            safe_invoke(
                "prefill.emit",
                self.emit,
                room_record(
                    role="prefill", stage="prefill_send", room=room.room, attempt=room.attempt,
                    digest=digest, layout=self.engine.layout.name, extra=dict(extra) if extra else None,
                ),
            )
