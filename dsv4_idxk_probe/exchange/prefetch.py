"""Fetch a room's prefill digest off the caller's thread, ahead of the moment it is needed.

Enforce mode judges each room as its prebuilt batch forms, on SGLang's decode
scheduler thread. Where the room's digest did not ride in band (Mooncake
sends the aux data before prefill's digest is ready; PP stages each send a
part), it must come from the exchange, and a fetch there may take up to
``exchange.timeout_ms``. So the fetch starts when the room lands (`prefetch`,
from the commit hook), runs on a small pool of worker threads, and the judge
only looks at where it stands (`prefetched`): done, or still in flight (the
room is then held for a later batch: sglang/enforce.py). The scheduler
thread never waits on the network.

The table is bounded (the oldest entries go first, their fetches cancelled if
not yet started, so the workers' queue holds no more live work than the table);
a room is forgotten once its answer has been read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

ATTR = "_dsv4_idxk_prefetcher"  # on a decode side: its Prefetcher, made at the first prefetch
WORKERS = 2
DEFAULT_CAP = 4096

_make_lock = threading.Lock()


class Prefetcher:
    """Keyed, bounded background fetches through `fetch(key)` (which never raises: it
    returns a digest or None)."""

    def __init__(self, fetch: Any, cap: int = DEFAULT_CAP, workers: int = WORKERS):
        self._fetch = fetch
        self._cap = max(1, int(cap))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dsv4-idxk-prefetch")
        self._futures: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()

    def start(self, key: str) -> None:
        """Begin fetching `key` unless it is already under way; returns at once."""
        with self._lock:
            if key in self._futures:
                return
            self._futures[key] = self._pool.submit(self._fetch, key)
            while len(self._futures) > self._cap:
                self._futures.popitem(last=False)[1].cancel()  # not started: its fetch never runs

    def poll(self, key: str) -> tuple[bool, Any]:
        """(done, digest or None). Not started: (False, None) after starting it now.
        A done answer is handed out once and forgotten."""
        with self._lock:
            future = self._futures.get(key)
        if future is None:
            self.start(key)
            return False, None
        if not future.done():
            return False, None
        with self._lock:
            self._futures.pop(key, None)
        try:
            return True, future.result()
        except Exception:  # the fetch promised not to raise; a bug costs this room's judgement only
            return True, None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _prefetcher(side: Any) -> Prefetcher:
    found = getattr(side, ATTR, None)
    if found is None:
        with _make_lock:
            found = getattr(side, ATTR, None)
            if found is None:
                fetch = getattr(side, "fetch_to_localise", None) or side.fetch
                found = Prefetcher(fetch, getattr(side, "_peers_cap", DEFAULT_CAP))
                setattr(side, ATTR, found)
    return found


def prefetch(side: Any, key: str) -> None:
    """Start fetching room `key`'s prefill digest on a worker thread."""
    _prefetcher(side).start(key)


def prefetched(side: Any, key: str) -> tuple[bool, Any]:
    """Where room `key`'s fetch stands: (True, digest or None) once done, (False, None)
    while in flight (started now if it was not)."""
    return _prefetcher(side).poll(key)
