"""Prefill side: digest each room as its last chunk leaves, and keep its vectors.

The room digest goes in band (`InbandDigest`, read from the returned
`PendingDigest` once the stream is past the kernel); the (layer, segment)
matrix and page vector, needed only to localise, stay in a bounded table
that the exchange serves to decode, and go to the room log.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Sequence

from ..digest.engine import BatchResult, DigestEngine, PendingDigest
from ..digest.result import RoomDigest
from ..digest.room_table import RoomRequest
from ..metrics.definitions import ProbeMetrics
from ..safety import safe_invoke
from .records import room_record
from .rooms import RoomId

Emit = Callable[[dict], Any]


class RecentRooms:
    """Bounded LRU of recent room digests, shared by the collector and the exchange threads."""

    def __init__(self, capacity: int):
        self.capacity = max(1, int(capacity))
        self._items: OrderedDict[str, RoomDigest] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted = 0

    def put(self, digest: RoomDigest) -> None:
        with self._lock:
            self._items[digest.key] = digest
            self._items.move_to_end(digest.key)
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
    """Digests rooms at `prefill_send`; results are logged and kept for the exchange."""

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
        self.recent = RecentRooms(table_size)
        # Room-log extras (SGLang's rid, ...) of rooms whose digest is in flight;
        # bounded like the table, in case a result never comes back.
        self._extras: OrderedDict[str, dict] = OrderedDict()
        self._extras_cap = max(1, int(table_size))
        self._extras_lock = threading.Lock()

    def rooms_sent(self, rooms: Sequence[tuple[RoomId, Any, int]],
                   extras: Sequence[dict | None] | None = None) -> PendingDigest | None:
        """Digest rooms whose last chunk is being sent: (room id, pages, tokens) each.

        `pages` are the room's physical pages from the first transferred page
        (after any decode-side prefix), `tokens` the tokens they hold.
        `extras` (one per room, or None) go into the room's record; a ``rid``
        key becomes the record's ``rid``.
        """
        requests = [RoomRequest(rid.key, pages, n_tokens) for rid, pages, n_tokens in rooms]
        keys = [r.key for r in requests]
        if extras:
            self._remember_extras(keys, extras)
        # The send path asks ready() right after NIXL's sync, to fill the in-band slot:
        # the batch's event is recorded right behind the kernel, so that works.
        pending = self.engine.submit(requests, self._on_result)
        if pending is None and extras:
            self._take_extras(keys)
        return pending

    def room_sent(self, room: RoomId, pages: Any, n_tokens: int, extra: dict | None = None) -> PendingDigest | None:
        return self.rooms_sent([(room, pages, n_tokens)], [extra] if extra else None)

    def _remember_extras(self, keys: Sequence[str], extras: Sequence[dict | None]) -> None:
        with self._extras_lock:
            for key, extra in zip(keys, extras):
                if extra:
                    self._extras[key] = dict(extra)
                    self._extras.move_to_end(key)
            while len(self._extras) > self._extras_cap:
                self._extras.popitem(last=False)

    def _take_extras(self, keys: Sequence[str]) -> list[dict | None]:
        with self._extras_lock:
            return [self._extras.pop(key, None) for key in keys]

    def lookup(self, key: str) -> RoomDigest | None:
        """The full digest of a recent room, for the exchange; None once evicted."""
        return self.recent.get(key)

    def _on_result(self, batch: BatchResult) -> None:
        extras = self._take_extras([d.key for d in batch.digests]) if self._extras else [None] * len(batch.digests)
        for digest, extra in zip(batch.digests, extras):
            self.recent.put(digest)
            room = RoomId.from_key(digest.key)
            safe_invoke(
                "prefill.emit",
                self.emit,
                room_record(
                    role="prefill", stage="prefill_send", room=room.room, attempt=room.attempt,
                    digest=digest, layout=self.engine.layout.name, extra=extra,
                ),
            )
        if self.metrics is not None:
            self.metrics.rooms_digested.labels(stage="prefill_send").inc(len(batch.digests))
            self.metrics.digest_bytes.labels(stage="prefill_send").inc(batch.bytes_digested)
            if batch.gpu_seconds is not None:
                self.metrics.digest_gpu_seconds.labels(stage="prefill_send").observe(batch.gpu_seconds)
