"""Manners for the probe's background threads in a process whose serving thread needs the GIL.

While one thread runs Python, CPython hands the GIL to a waiting thread only
every ``sys.getswitchinterval()`` (5 ms) or when the running thread blocks.
A background thread that folds and logs a 64-room batch in one go would make
the scheduler thread wait for all of it. Blocking for a moment between
rooms hands the GIL over at once; ``sleep(0)`` does not reliably, because the
sleeper usually takes the GIL back before the waiter is scheduled.
"""

from __future__ import annotations

import time

YIELD_S = 20e-6  # Linux sleeps at least its timer slack (~50 us): short next to a decode batch


def yield_to_serving() -> None:
    """Between units of background work: let a waiting serving thread run."""
    time.sleep(YIELD_S)
