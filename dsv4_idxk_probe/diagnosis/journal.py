"""The page journal: the last operations the hooks saw on each physical index-K page.

One bounded ring of events per process, in time order. An event names its
pages as the hook got them (a list, a NumPy array, a host tensor, or a device
tensor's `host_ids.capture`: a copy queued to pinned memory), held by
reference: recording one is a tuple append and a monotonic clock read, O(1)
whatever the room's size, no host sync, no per-token work (a decode room's
events are recorded on the collector with the time the serving thread saw,
`record_captured(..., t_ns)`, and slotted in behind the few events newer than it). Pages are turned
into host numbers only when a mismatch asks which events touched a page (on
the collector thread, rarely), which waits for the capture's event at most.

Bound: `capacity` events. The oldest go first, so a page untouched for a
long time may have none left; the journal then says nothing rather than
something wrong.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Iterable

import numpy as np

from .host_ids import capture, host_ints, tensor_type

# What the hooks record (docs/diagnosis.md, "The journal").
EVENT_KINDS = ("allocated", "transfer_landed", "hicache_load", "hicache_backup", "freed")


class PageGroups:
    """Token indices that come in whole pages (HiCache's page branch): page k is the
    first index of group k divided by the page size. Only those first indices are kept
    (captured at the hook: `host_ids.capture`), resolved on read: the copy's whole token
    indices, held per event, were the page size times as much (256: 16 KiB an event for a
    4-page copy, where the journal's bound counts events)."""

    __slots__ = ("indices", "page_size")

    def __init__(self, indices: Any, page_size: int):
        self.page_size = int(page_size)
        self.indices = capture(_page_firsts(indices, self.page_size))

    def resolve(self) -> np.ndarray:
        return host_ints(self.indices) // self.page_size if self.page_size > 0 else np.zeros(0, dtype=np.int64)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.indices)


def _page_firsts(indices: Any, page_size: int) -> Any:
    """The first index of each whole page of `indices`, a copy of its own (a device tensor
    stays on its device: a strided view, copied by `capture` on the stream)."""
    if page_size <= 0:
        return np.zeros(0, dtype=np.int64)
    tensor = tensor_type()
    if tensor is not None and isinstance(indices, tensor):  # (a NumPy 2 array has a `device` too)
        flat = indices.reshape(-1)
        firsts = flat[: flat.numel() - flat.numel() % page_size : page_size]
        return firsts if firsts.device.type == "cuda" else firsts.clone()
    flat = np.asarray(indices, dtype=np.int64).reshape(-1)
    return flat[: flat.size - flat.size % page_size : page_size].copy()


def on_index_k_pages(pool: str | None) -> bool:
    """Whether an event of `pool` (None: the PD path's) numbers the pages it names as the
    C4 index-K pages are numbered: SGLang's C4 indexer host pool does; the other pools'
    copies (HiSparse's C4 KV, V4.1's low-ratio index pools) name pages of their own, and
    one of the same number never touched index-K's."""
    return pool is None or "c4_indexer" in str(pool)


def _nbytes(values: Any) -> int:
    """Host bytes `values` holds (a device tensor's: none)."""
    if values is None:
        return 0
    if hasattr(values, "element_size"):
        return values.numel() * values.element_size() if values.device.type == "cpu" else 0
    if hasattr(values, "nbytes"):
        return int(values.nbytes)
    return 8 * len(values) + 56


#: Resolving an event drops its references: readers on two threads must not both do it.
_RESOLVE_LOCK = threading.Lock()


class _Event:
    __slots__ = ("t_ns", "kind", "room", "pages", "host_rows", "layer", "detail", "_resolved")

    def __init__(self, t_ns, kind, room, pages, host_rows, layer, detail):
        self.t_ns, self.kind, self.room, self.pages = t_ns, kind, room, pages
        self.host_rows, self.layer, self.detail, self._resolved = host_rows, layer, detail, None

    def resolved(self) -> tuple[np.ndarray, np.ndarray | None]:
        if self._resolved is None:  # once per event; the references are dropped then
            with _RESOLVE_LOCK:  # two readers (a collector, the serving thread) resolve it once
                if self._resolved is None:
                    host = host_ints(self.host_rows) if self.host_rows is not None else None
                    self._resolved = (host_ints(self.pages), host)
                    self.pages = self.host_rows = None
        return self._resolved

    def describe(self, page: int) -> dict:
        pages, host = self.resolved()
        out = {"t_ns": self.t_ns, "event": self.kind, "page": int(page)}
        if self.room is not None:
            out["room"] = self.room
        if host is not None:
            at = np.flatnonzero(pages == page)
            if at.size and at[0] < host.size:
                out["host_row"] = int(host[at[0]])
        if self.layer is not None:
            out["layer"] = self.layer
        if self.detail:
            rows = self.detail.get("host_rows")  # round trip: {host row: what it found}
            out.update({k: v for k, v in self.detail.items() if k != "host_rows"})
            if rows is not None and "host_row" in out and out["host_row"] in rows:
                out["host_row_checks"] = rows[out["host_row"]]
        return out


class PageJournal:
    """Bounded per-process journal of page events (thread-safe appends)."""

    def __init__(self, capacity: int = 16384, per_page: int = 8, clock=time.monotonic_ns):
        if capacity < 1 or per_page < 1:
            raise ValueError("journal capacity and per_page must be at least 1")
        self.capacity = capacity
        self.per_page = per_page
        self._clock = clock
        self._events: deque[_Event] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.recorded = 0

    def now(self) -> int:
        return self._clock()

    def record(self, kind: str, pages: Any, room: str | None = None, *, host_rows: Any = None,
               layer: int | None = None, detail: dict | None = None) -> None:
        """One event on `pages` (physical index-K page ids, in any container, or
        `PageGroups`): O(1); a device tensor is captured (`host_ids.capture`) unless
        the caller did. `detail` is a small dict shown with the event."""
        event = _Event(self._clock(), kind, room, capture(pages), capture(host_rows), layer, detail)
        with self._lock:  # deque appends are atomic, but the counter is not
            self._events.append(event)
            self.recorded += 1

    def record_captured(self, kind: str, pages: Any, room: str | None = None, t_ns: int | None = None) -> None:
        """`record` for pages already captured by the caller (`host_ids.capture` of them, or
        a host container): a room's events skip the capture checks. `t_ns`: when the
        event happened, if before now (the decode monitor journals on its collector what
        the serving thread saw earlier): the event goes in its place in time order, after
        the later events recorded meanwhile are set aside, so reads that stop at the
        first event older than their window stay right."""
        event = _Event(self._clock() if t_ns is None else t_ns, kind, room, pages, None, None, None)
        with self._lock:
            events = self._events
            if t_ns is not None and events and events[-1].t_ns > t_ns:
                later = []
                while events and events[-1].t_ns > t_ns:
                    later.append(events.pop())
                events.append(event)
                events.extend(reversed(later))
            else:
                events.append(event)
            self.recorded += 1

    def __len__(self) -> int:
        return len(self._events)

    def _snapshot(self) -> list[_Event]:
        with self._lock:
            return list(self._events)

    def events_for(self, page: int, since_ns: int | None = None, until_ns: int | None = None,
                   limit: int | None = None, pools: Any = None) -> list[dict]:
        """Events that touched physical `page` with since < t <= until, oldest first,
        at most `limit` (default `per_page`) of the newest of them. `pools`: only events
        whose pool (None for the PD path's) it accepts (`on_index_k_pages`)."""
        limit = limit or self.per_page
        found: list[dict] = []
        for event in reversed(self._snapshot()):
            if until_ns is not None and event.t_ns > until_ns:
                continue
            if since_ns is not None and event.t_ns <= since_ns:
                break
            if pools is not None and not pools((event.detail or {}).get("pool")):
                continue
            if (event.resolved()[0] == page).any():
                found.append(event.describe(page))
                if len(found) >= limit:
                    break
        return found[::-1]

    def previous_owner(self, page: int, before_ns: int, not_room: str | None) -> str | None:
        """The room of the last allocated/freed event on `page` before `before_ns` that is
        not `not_room`: who held the page before it was handed to `not_room`."""
        for event in reversed(self._snapshot()):
            if event.t_ns >= before_ns or event.kind not in ("allocated", "freed") or event.room is None:
                continue
            if event.room != not_room and (event.resolved()[0] == page).any():
                return event.room
        return None

    def allocated_at(self, room: str, pages: Iterable[int] | None = None) -> int | None:
        """Time of the last `allocated` event of `room` (None when the journal lost it)."""
        for event in reversed(self._snapshot()):
            if event.kind == "allocated" and event.room == room:
                return event.t_ns
        return None

    def nbytes(self) -> int:
        """Approximate host memory held: events, and the page lists they name."""
        total = 0
        for event in self._snapshot():
            total += 120
            for values in (event.pages, event.host_rows) if event._resolved is None else event._resolved:
                total += _nbytes(values)
        return total
