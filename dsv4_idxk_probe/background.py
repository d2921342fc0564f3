"""Manners for the probe's background threads in a process whose serving thread needs the GIL.

While one thread runs Python, CPython hands the GIL to a waiting thread only
every ``sys.getswitchinterval()`` (5 ms) or when the running thread blocks.
A background thread that folds and logs a 64-room batch in one go would make
the scheduler thread wait for all of it. Blocking for a moment between
rooms hands the GIL over at once; ``sleep(0)`` does not reliably, because the
sleeper usually takes the GIL back before the waiter is scheduled.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time

YIELD_S = 20e-6  # Linux sleeps at least its timer slack (~50 us): short next to a decode batch


def yield_to_serving() -> None:
    """Between units of background work: let a waiting serving thread run."""
    time.sleep(YIELD_S)


class HandOff:
    """Items from serving threads to one background thread, at the price of a deque
    append on the serving thread (and a lock release when the consumer sleeps).

    Why not `queue.Queue`: its `put_nowait` runs ten Python functions (condition,
    locks, notify), and on a serving thread that comes back from a model step
    every function costs tens of microseconds (docs/overhead.md).
    """

    def __init__(self):
        self.items: collections.deque = collections.deque()  # read its len() without a call
        self._bell = threading.Lock()  # held: nothing rung since the consumer last woke
        self._bell.acquire()
        self._sleeping = False

    def put(self, item) -> None:
        self.items.append(item)
        if self._sleeping:
            try:
                self._bell.release()
            except RuntimeError:  # rung already
                pass

    def get(self, check_every_s: float = 0.5):
        """The next item, waiting as long as it takes (the consumer's thread only).

        A producer that appends before the consumer says it sleeps is seen by the
        check below; one that appends after rings. The timeout only bounds the
        damage of a mistake in that argument.
        """
        items = self.items
        while True:
            try:
                return items.popleft()
            except IndexError:
                pass
            self._sleeping = True
            if not items:
                self._bell.acquire(timeout=check_every_s)
            self._sleeping = False


@contextlib.contextmanager
def every(seconds: float, call, *, first: float | None = None, name: str = "dsv4-idxk-probe-every"):
    """Call `call()` on a daemon thread after `first` (default `seconds`) and then every
    `seconds` while the `with` block runs: a progress line during a long wait. A failing
    call ends the thread, never the block."""
    stop = threading.Event()

    def loop() -> None:
        wait = seconds if first is None else first
        while not stop.wait(wait):
            try:
                call()
            except Exception:
                return
            wait = seconds

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=seconds + 1)
