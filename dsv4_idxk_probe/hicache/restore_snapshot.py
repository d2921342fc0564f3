"""Restore digests of a pool whose device layers live on the CPU (the rig): the bytes
are captured on the copying thread, digested on the collector.

On a GPU the digest engine launches on the copy's stream and the copying thread only
launches. Without one the engine digests with the NumPy reference at submit time, on
the copying thread: about 50 us per (layer, page), several times the copy itself. What
must happen at the copy's instant is only that the bytes are taken as the copy left
them, so here the copying thread copies the pages (one `index_select` per layer) and
the engine's collector digests the copy with the same reference (`checked_room_cells`:
content digests depend on the bytes alone, so they equal the engine's), in the engine's
queue order (`DigestEngine.post`), and hands the callback what a submit would.

Bounded: copies waiting for the collector hold at most `max_bytes` (one is always let
through); more are refused and counted `queue_full` by the caller.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

#: Bytes of page copies waiting for the collector, per pool (a 30-layer x 16-page fp8 copy is 4 MiB).
MAX_PENDING_BYTES = 64 << 20


class SnapshotDigests:
    """The copy-then-digest path of one CPU pool, on its engine's collector."""

    def __init__(self, engine: Any, max_bytes: int = MAX_PENDING_BYTES):
        self.engine = engine
        self.buffers = list(engine.buffers)
        self.layout = engine.layout
        self.layer_ids = list(engine.layer_ids)
        self.max_bytes = int(max_bytes)
        self._row_bytes = sum(int(b.shape[1]) for b in self.buffers)  # one page over all layers
        self._pending = 0
        self._lock = threading.Lock()

    def submit(self, page_ids, n_pages: int, n_tokens: int, callback: Callable[[Any], None]) -> bool:
        """Copy the pages now; digest them on the collector. False (nothing copied) when
        the copies already waiting hold `max_bytes`."""
        nbytes = n_pages * self._row_bytes
        with self._lock:
            if self._pending and self._pending + nbytes > self.max_bytes:
                return False
            self._pending += nbytes
        try:
            rows = [buf.index_select(0, page_ids) for buf in self.buffers]
        except BaseException:
            self._release(nbytes)
            raise
        self.engine.post(self._digest, (rows, n_tokens, callback, nbytes))
        return True

    def _digest(self, arg) -> None:
        rows, n_tokens, callback, nbytes = arg
        try:
            result = self._contents(rows, n_tokens)
        except Exception as exc:  # told to the callback, which counts it
            result = SimpleNamespace(error=f"{type(exc).__name__}: {exc}", contents=(), out_of_range=())
        finally:
            self._release(nbytes)
        callback(result)

    def _contents(self, rows: list, n_tokens: int):
        from ..digest.launch import checked_room_cells

        n_pages, n_segments = int(rows[0].shape[0]), len(self.layout.segments)
        cells = np.zeros((len(rows), n_pages, n_segments), dtype=np.uint64)
        contents = np.zeros_like(cells)
        flags = np.zeros((len(rows), n_pages), dtype=np.uint8)
        checked_room_cells(rows, np.arange(n_pages), n_tokens, self.layout, self.layer_ids, cells, flags, contents)
        return SimpleNamespace(error=None, contents=(contents,), out_of_range=(int(flags.sum()),))

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._pending -= nbytes

    @property
    def pending_bytes(self) -> int:
        return self._pending
