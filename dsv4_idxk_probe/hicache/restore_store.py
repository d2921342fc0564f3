"""The digests of host pages as their backup read them, kept until a load compares them.

One entry per (pool, host row): the content digest of every (layer, segment) of the
device page the backup copied into that row, uint64 [layers, segments]
(docs/digest.md, "Content digests": they depend on the bytes only, so a page loaded
into any device page compares with the digest its backup took from another).

Bounded: at most `max_pages` entries over all pools; storing past that evicts the
oldest (least recently stored) and counts them through `on_evict`. An entry costs
8 B x layers x segments for the digests plus about `ENTRY_OVERHEAD_BYTES` of Python
object (docs/hicache.md, "Restore verification"). A row whose digest was evicted or
dropped (the storage tier wrote the page) is remembered as lost, in a second table
of the same bound, so its load is counted `unverified` with reason `digest_lost`
instead of not at all.

Forgetting all of a pool's digests (`forget_all`) is O(1) for its caller, which may be
SGLang's copying thread: each entry carries its pool's epoch when stored, and
`forget_all` moves the pool to a new epoch. An entry of an older epoch reads as
forgotten (absent, and lost) at once; the `put`s after it (the collector) sweep such
entries out of the table into the lost table, `SWEEP_CHUNK` keys a call, over a list of
the table's keys taken (in C) at the first of them: no call walks the whole table in Python.

Plain NumPy; thread-safe (the collector stores, the serving thread drops).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Iterable

import numpy as np

#: Python object overhead of one entry (dict slot, key tuple, the (epoch, array) pair,
#: array header), measured with sys.getsizeof on CPython 3.11 and rounded up.
ENTRY_OVERHEAD_BYTES = 310

#: keys a `put` looks at while forgotten entries are swept out (module docstring)
SWEEP_CHUNK = 4096


def entry_bytes(layers: int, segments: int) -> int:
    """Host memory one kept host page costs, overhead included."""
    return 8 * int(layers) * int(segments) + ENTRY_OVERHEAD_BYTES


class HostPageDigests:
    """(pool key, host row) -> (epoch, uint64 [layers, segments]), bounded, oldest evicted first."""

    def __init__(self, max_pages: int, on_evict: Callable[[int], None] | None = None,
                 on_stored_lost: Callable[[int, int], None] | None = None):
        if max_pages < 1:  # a store that keeps nothing would count its backups verified
            raise ValueError(f"max_pages must be >= 1, got {max_pages}")
        self.max_pages = int(max_pages)
        self._on_evict = on_evict
        self._table: OrderedDict[tuple[int, int], tuple[int, np.ndarray]] = OrderedDict()
        # per pool, the epoch its live entries carry; `forget_all` moves it on, and the
        # pools in `_unswept` may still have entries of an older one in the table
        self._epochs: dict[int, int] = {}
        self._unswept: set[int] = set()
        self._sweep_keys: list[tuple[int, int]] | None = None  # the sweep under way: the keys it looks at,
        self._sweep_at = 0  # how far it got,
        self._sweeping: set[int] = set()  # and the pools it sweeps
        # Entries a storage-tier page brought (`put(stored=True)`) that no load has compared
        # yet, rows per pool: such a page counts verified once a load compares it
        # (`take_stored`), and unverified if its entry goes first (`on_stored_lost(pool,
        # n_rows)`, outside the lock).
        self._stored: dict[int, set[int]] = {}
        self._on_stored_lost = on_stored_lost
        self._lost: OrderedDict[tuple[int, int], None] = OrderedDict()  # evicted or dropped, not stored again
        self._lock = threading.Lock()
        self.evicted = 0
        # per pool, how many times its digests were forgotten out of the collector's order
        # (`forget_all(fence=True)`): a digest submitted before that may describe a row's
        # former bytes, and is not stored (`put(generation=)`). A backup notes its pool's
        # count when it is submitted (`generations.get(pool, 0)`: one C call, no frame on
        # the copying thread).
        self.generations: dict[int, int] = {}
        self.fence_cause: dict[int, str] = {}  # per pool, the coverage reason of its last fence

    def put(self, pool: int, rows: Iterable[int], contents: np.ndarray, generation: int | None = None,
            stored: bool = False) -> bool:
        """Keep `contents[:, j, :]` for host row `rows[j]`; `contents` is uint64 [layers, pages, segments].
        With `generation` (the pool's when the digest was submitted): nothing is kept, the rows
        are remembered as lost and False returned if the pool's digests were forgotten since.
        `stored`: the digests came with a storage-tier page, for `take_stored`."""
        rows = [int(r) for r in rows]
        if contents.ndim != 3 or contents.shape[1] != len(rows):
            raise ValueError(f"contents {contents.shape} do not hold {len(rows)} pages as [layers, pages, segments]")
        keys = [(pool, row) for row in rows]
        evicted = 0
        with self._lock:
            if self._unswept or self._sweep_keys is not None:
                self._sweep_some()
            refused = generation is not None and generation != self.generations.get(pool, 0)
            epoch = self._epochs.get(pool, 0)
            for j, key in enumerate(keys):
                self._table.pop(key, None)
                if refused:
                    self._remember_lost(key)
                    continue
                self._lost.pop(key, None)
                self._table[key] = (epoch, np.array(contents[:, j, :], dtype=np.uint64, copy=True))
            gone = self._stored_taken(keys)  # a stored page's entry replaced before a load compared it
            if stored and not refused:  # (refused: the caller counts it, seeing False)
                self._stored.setdefault(pool, set()).update(rows)
            while len(self._table) > self.max_pages:
                key, (kept_epoch, _) = self._table.popitem(last=False)
                self._remember_lost(key)
                gone += self._stored_taken([key])
                evicted += kept_epoch == self._epochs.get(key[0], 0)  # a forgotten one was no eviction
            self.evicted += evicted
        self._report_stored_lost(gone)
        if evicted and self._on_evict is not None:
            self._on_evict(evicted)
        return not refused

    def take_stored(self, pool: int, rows: Iterable[int]) -> int:
        """How many of these rows hold a storage-tier page's digests that no load had compared:
        a load compared them now, so they count here, once."""
        with self._lock:
            return len(self._stored_taken([(pool, int(r)) for r in rows]))

    def _stored_taken(self, keys: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """(Under the lock) which of `keys` are stored pages not yet compared; no longer so."""
        if not self._stored:
            return []
        taken = []
        for key in keys:
            rows = self._stored.get(key[0])
            if rows is not None and key[1] in rows:
                rows.discard(key[1])
                taken.append(key)
        return taken

    def _report_stored_lost(self, keys: list[tuple[int, int]]) -> None:
        """(Outside the lock) stored pages whose entries went before a load compared them."""
        if not keys or self._on_stored_lost is None:
            return
        by_pool: dict[int, int] = {}
        for pool, _ in keys:
            by_pool[pool] = by_pool.get(pool, 0) + 1
        for pool, n in by_pool.items():
            self._on_stored_lost(pool, n)

    def get(self, pool: int, rows: Iterable[int]) -> list[np.ndarray | None]:
        """The kept digests of each row ([layers, segments]), None where none is kept."""
        with self._lock:
            epoch = self._epochs.get(pool, 0)
            entries = [self._table.get((pool, int(row))) for row in rows]
        return [entry[1] if entry is not None and entry[0] == epoch else None for entry in entries]

    def lost(self, pool: int, row: int) -> bool:
        """Whether a digest of this row was kept once and evicted, dropped or forgotten since."""
        key = (pool, int(row))
        with self._lock:
            entry = self._table.get(key)
            return key in self._lost or (entry is not None and entry[0] != self._epochs.get(pool, 0))

    def drop(self, pool: int, rows: Iterable[int]) -> int:
        """Forget these rows' digests (the storage tier wrote the pages); returns how many were kept."""
        dropped = 0
        keys = [(pool, int(row)) for row in rows]
        with self._lock:
            epoch = self._epochs.get(pool, 0)
            for key in keys:
                entry = self._table.pop(key, None)
                dropped += entry is not None and entry[0] == epoch
                self._remember_lost(key)
            gone = self._stored_taken(keys)
        self._report_stored_lost(gone)
        return dropped

    def forget_all(self, pool: int, fence: bool = False, cause: str = "queue_full") -> None:
        """Forget every kept digest of a pool, remembered as lost (a backup whose rows could
        not be read: any of them may be stale now). `fence`: called out of the collector's
        order (the copying thread), so digests submitted before this and stored after it are
        refused too (`put(generation=)`). O(1) but for the pool's stored pages not yet
        compared, reported lost here: the entries go by epoch (the module's docstring)."""
        with self._lock:
            if fence:
                self.generations[pool] = self.generations.get(pool, 0) + 1
                self.fence_cause[pool] = cause
            self._epochs[pool] = self._epochs.get(pool, 0) + 1
            self._unswept.add(pool)
            gone = [(pool, row) for row in self._stored.pop(pool, ())]
        self._report_stored_lost(gone)

    def _sweep_some(self) -> None:
        """(Under the lock) move up to `SWEEP_CHUNK` entries of forgotten epochs to the lost
        table. A sweep looks at the keys the table held when it began: entries stored since
        carry their pool's epoch, unless the pool was forgotten again, which the next sweep
        (the pool back in `_unswept`) takes."""
        if self._sweep_keys is None:
            self._sweep_keys, self._sweep_at = list(self._table), 0
            self._sweeping, self._unswept = self._unswept, set()
        keys, start = self._sweep_keys, self._sweep_at
        end = min(len(keys), start + SWEEP_CHUNK)
        table, epochs, sweeping = self._table, self._epochs, self._sweeping
        for key in keys[start:end]:
            if key[0] in sweeping:
                entry = table.get(key)
                if entry is not None and entry[0] != epochs.get(key[0], 0):
                    del table[key]
                    self._remember_lost(key)
        self._sweep_at = end
        if end == len(keys):
            self._sweep_keys, self._sweeping = None, set()

    def forget_pool(self, pool: int) -> None:
        """A pool that is gone: its rows' digests go with it (not counted as evictions)."""
        with self._lock:
            self.generations[pool] = self.generations.get(pool, 0) + 1
            for table in (self._table, self._lost):
                for key in [k for k in table if k[0] == pool]:
                    del table[key]
            self._stored.pop(pool, None)  # gone with the pool, uncounted

    def _remember_lost(self, key: tuple[int, int]) -> None:
        self._lost.pop(key, None)
        self._lost[key] = None
        while len(self._lost) > self.max_pages:
            self._lost.popitem(last=False)

    def __len__(self) -> int:
        """Digests kept (entries of forgotten epochs not swept yet left out)."""
        with self._lock:
            return sum(1 for key, (epoch, _) in self._table.items() if epoch == self._epochs.get(key[0], 0))
