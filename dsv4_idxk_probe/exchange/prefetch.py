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

A hold is bounded: a fetch not done `deadline_s` after it was started
(``timeout_ms`` + ``retry_s``, the longest one fetch may take, queueing
included) is given up and the room admitted unjudged; so is a room whose
entry the bounded table had to let go (the oldest first, their fetches
cancelled if not yet started), which is never started again (it was, and a
full table would drop it again before its turn: held forever). A worker
waits out a peer's backoff while it asks again, so there are enough of them
that rooms landing at once do not queue behind those waits. A room is
forgotten once its answer has been read.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

ATTR = "_dsv4_idxk_prefetcher"  # on a decode side: its Prefetcher, made at the first prefetch
WORKERS = 8  # each mostly sleeps in a peer's backoff (exchange/client.py); rooms land in bursts
DEFAULT_CAP = 4096

_make_lock = threading.Lock()


class Prefetcher:
    """Keyed, bounded background fetches through `fetch(key)` (which never raises: it
    returns a digest or None). `deadline_s`: a fetch still running this long after its
    start is given up (None: never); `gave_up()` is told of each room given up."""

    def __init__(self, fetch: Any, cap: int = DEFAULT_CAP, workers: int = WORKERS, *,
                 deadline_s: float | None = None, gave_up: Callable[[], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._fetch = fetch
        self._clock = clock
        self._cap = max(1, int(cap))
        self._deadline_s = deadline_s
        self._gave_up = gave_up
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dsv4-idxk-prefetch")
        self._futures: OrderedDict[str, tuple[Future, float]] = OrderedDict()  # key -> (fetch, started)
        self._dropped: OrderedDict[str, None] = OrderedDict()  # keys the full table let go, as many at most
        self._lock = threading.Lock()

    def start(self, key: str, fresh: bool = False) -> None:
        """Begin fetching `key` unless it is already under way (or was let go); returns at once.
        `fresh`: the room landed again (a rebootstrap resends the same room id): an earlier
        fetch of it, done or not, answers for the earlier transfer and is let go."""
        with self._lock:
            if fresh:
                earlier = self._futures.pop(key, None)
                if earlier is not None:
                    earlier[0].cancel()
                self._dropped.pop(key, None)
            elif key in self._futures or key in self._dropped:
                return
            self._futures[key] = (self._pool.submit(self._fetch, key), self._clock())
            while len(self._futures) > self._cap:
                old, (future, _) = self._futures.popitem(last=False)
                future.cancel()  # not started: its fetch never runs
                self._dropped[old] = None
                if len(self._dropped) > self._cap:
                    self._dropped.popitem(last=False)

    def poll(self, key: str) -> tuple[bool, Any]:
        """(done, digest or None). Not started: (False, None) after starting it now. Let go
        by the full table, or past its deadline: (True, None), counted. A done answer is
        handed out once and forgotten."""
        future, done = None, False
        with self._lock:
            if key in self._dropped:
                del self._dropped[key]
                late = True  # its fetch was cancelled when the table let it go
            else:
                entry = self._futures.get(key)
                if entry is None:
                    late = None
                else:
                    future, started = entry
                    done = future.done()  # read once: what is forgotten here is what is handed out
                    late = (not done and self._deadline_s is not None
                            and self._clock() - started > self._deadline_s)
                    if late or done:
                        del self._futures[key]
        if late is None:
            self.start(key)
            return False, None
        if late:
            if future is not None:
                future.cancel()  # still queued: never runs (the workers' time goes to rooms still held)
            self._give_up()
            return True, None
        if not done:
            return False, None
        try:
            return True, future.result()
        except Exception:  # the fetch promised not to raise; a bug costs this room's judgement only
            return True, None

    def _give_up(self) -> None:
        if self._gave_up is not None:
            try:
                self._gave_up()
            except Exception:
                pass  # a count; never the caller's problem

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _prefetcher(side: Any) -> Prefetcher:
    found = getattr(side, ATTR, None)
    if found is None:
        with _make_lock:
            found = getattr(side, ATTR, None)
            if found is None:
                fetch = getattr(side, "fetch_to_localise", None) or side.fetch
                client = getattr(side, "client", None)
                found = Prefetcher(fetch, getattr(side, "_peers_cap", DEFAULT_CAP),
                                   deadline_s=fetch_deadline_s(client, getattr(side, "_retry_s", 0.0)),
                                   gave_up=getattr(client, "count_late", None))
                setattr(side, ATTR, found)
    return found


def fetch_deadline_s(client: Any, retry_s: float) -> float | None:
    """The longest one fetch may take: the client's per-request timeout plus the retries'
    window (None without a client: nothing to bound). A room of several prefill PP stages
    asks them at once, within the one window (`VectorClient._fetch_stages`)."""
    timeout_ms = getattr(client, "timeout_ms", None)
    return None if timeout_ms is None else float(timeout_ms) / 1000.0 + float(retry_s or 0.0)


def prefetch(side: Any, key: str) -> None:
    """Start fetching room `key`'s prefill digest on a worker thread, as its transfer lands
    (afresh: what an earlier transfer of the same room fetched is not this one's)."""
    _prefetcher(side).start(key, fresh=True)


def prefetched(side: Any, key: str) -> tuple[bool, Any]:
    """Where room `key`'s fetch stands: (True, digest or None) once done, (False, None)
    while in flight (started now if it was not)."""
    return _prefetcher(side).poll(key)
