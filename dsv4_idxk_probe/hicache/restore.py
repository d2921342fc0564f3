"""Restore verification (on by default): every index-K page a load writes is compared
with what its backup read.

* **Backup** (`after_backup`, behind `backup_from_device_all_layer`): the device pages
  the backup read are digested on the caller's current stream, right behind the copy,
  so the digest reads what the copy read. The content digests of every (layer,
  segment) are kept per host row (`restore_store.HostPageDigests`, bounded).
* **Load** (`after_load`, behind `load_to_device_per_layer`): after the pool's last
  layer of a load, the device pages the load wrote are digested on the same stream,
  so the digest reads what the load wrote; the collector compares them with the kept
  digests of their host rows (`restore_compare`). A difference is a finding at stage
  `hicache_load`, localised to (pool, layer, host row, device page, segment).

Nothing here waits for the device, and the copying thread does only what must happen
at that instant: it derives the device page ids on the indices' device (one division)
and launches the digest on its stream (digest/engine.py), holding references to the
index tensors. The engine's collector thread delivers the contents and reads the host
rows and device page numbers back from the held tensors (`restore_rows`), then stores
or compares. Without CUDA (the rig) the copying thread copies the pages instead and
the collector digests the copy with the NumPy reference (`restore_snapshot`). One engine (one
collector thread) per index-K host pool, so a model with several index-K pools has
several engines, each with its own layout.

Plain tensors and callbacks in; no SGLang.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..digest.layout import RowLayout, Segment, shipped_layouts
from ..vocabulary import HICACHE_STAGES
from .restore_compare import LoadComparison, compare_load
from .restore_rows import Captured, device_page_ids, read_rows
from .restore_store import HostPageDigests

_log = logging.getLogger("dsv4_idxk_probe.hicache")

STAGE = HICACHE_STAGES[0]  # "hicache_load"

#: A stored page's digests travel beside it under the page's storage key plus this suffix
#: (a sidecar key in the storage backend's own key space; docs/hicache.md, "The storage tier").
SIDECAR_SUFFIX = ".dsv4-idxk-digest"
#: First word of a sidecar: "dsv4idxk" as a little-endian uint64, then layers, segments, digests.
SIDECAR_MAGIC = int.from_bytes(b"dsv4idxk", "little")


def sidecar_bytes(layers: int, segments: int) -> int:
    return 8 * (3 + int(layers) * int(segments))


def encode_sidecar(digests: np.ndarray) -> np.ndarray:
    """A host row's kept digests (uint64 [layers, segments]) as the bytes of its sidecar."""
    layers, segments = digests.shape
    words = np.concatenate([np.array([SIDECAR_MAGIC, layers, segments], dtype=np.uint64),
                            np.asarray(digests, dtype=np.uint64).reshape(-1)])
    return words.view(np.uint8)


def decode_sidecar(data, layers: int, segments: int) -> np.ndarray | None:
    """The digests a sidecar carries, None when it is not one of this pool's shape."""
    data = np.asarray(data, dtype=np.uint8).reshape(-1)
    if data.size != sidecar_bytes(layers, segments):
        return None
    words = data.view(np.uint64)
    if int(words[0]) != SIDECAR_MAGIC or (int(words[1]), int(words[2])) != (layers, segments):
        return None
    return words[3:].reshape(layers, segments).copy()


#: Staging buffers (pinned host + device, 128 KiB each for a copy of up to ~130 pages x 30
#: layers) each pool's engine reserves at start-up: digests in flight at once before the
#: collector gives them back. One more is allocated on the copying thread (milliseconds).
PREALLOC = 16


def is_index_k_pool(name: str) -> bool:
    """SGLang names its index-K host pools ``deepseek_v4_c{1,2,4}_indexer`` (and
    ``draft_indexer``): the pools whose bytes this verifies and counts."""
    return "indexer" in str(name)


def pool_layout(name: str, item_bytes: int) -> RowLayout:
    """The shipped layout whose row is this pool's row, by row bytes (fp8 8448 B, fp4
    4352 B, bf16 16384 B: segments named as the PD side names them), or one segment
    over the whole row when none or several are."""
    matches = [lay for lay in shipped_layouts().values() if lay.row_bytes == item_bytes]
    if len(matches) == 1:
        return matches[0]
    return RowLayout(f"hicache-row-{item_bytes}", 1, 1, (Segment("row", 0, int(item_bytes)),), int(item_bytes))


@dataclass
class PoolRestore:
    """What restore verification keeps per host pool."""

    name: str
    layout: RowLayout
    engine: Any  # digest.engine.DigestEngine over the pool's device layers
    layers: int
    row_bytes: int
    page_size: int
    keys: dict = None  # path -> the digest's room key, made once
    snapshot: Any = None  # restore_snapshot.SnapshotDigests: a CPU pool's copy-then-digest path


class RestoreVerifier:
    """Backups digested and kept, loads digested and compared, for every index-K pool."""

    def __init__(self, max_pages: int, queue_max: int, report: Callable[[Any, LoadComparison, dict], None],
                 count: Callable[[str, str, str, int], None], on_evict: Callable[[int], None],
                 engine_factory: Callable[..., Any] | None = None):
        """`report(state, comparison, context)`: a load's comparison, on the collector thread.
        `count(path, outcome, reason, nbytes)`: coverage (ProbeMetrics.count_coverage)."""
        self.store = HostPageDigests(max_pages, on_evict)
        self.queue_max = queue_max
        self._report = report
        self._count = count
        self._engine_factory = engine_factory or _engine
        self._pools: dict[int, PoolRestore | None] = {}
        self._why_not: dict[int, str] = {}  # pool key -> coverage reason of a pool not verified
        self._lock = threading.Lock()

    # -- pools --------------------------------------------------------------------

    def pool(self, state) -> PoolRestore | None:
        """The pool's restore set-up (made once), None for a pool that is not index-K or
        whose rows cannot be digested (its moves are counted unverified)."""
        try:
            return self._pools[state.key]
        except KeyError:
            pass
        with self._lock:
            if state.key not in self._pools:
                try:
                    self._pools[state.key] = self._make(state)
                except Exception:  # tried once: its copies are counted unverified, never retried
                    _log.exception("dsv4-idxk-probe hicache pool %s: restore digests cannot be taken", state.geom.name)
                    self._pools[state.key] = None
                    self._why_not[state.key] = "probe_error"
            return self._pools[state.key]

    def why_not(self, state) -> str:
        """The coverage reason of an index-K pool that is not verified."""
        return self._why_not.get(state.key, "layout_unknown")

    def _make(self, state) -> PoolRestore | None:
        geom = state.geom
        if not is_index_k_pool(geom.name) or state.views is None or state.invariants_failed or not geom.layers:
            return None
        layout = pool_layout(geom.name, geom.item_bytes)
        buffers = [state.views.device_layer(layer) for layer in range(geom.layers)]
        engine = self._engine_factory(layout, list(range(geom.layers)), buffers, self.queue_max)
        snapshot = None
        if getattr(engine, "backend", None) == "reference":  # no GPU: digests would run on the copying thread
            from .restore_snapshot import SnapshotDigests

            snapshot = SnapshotDigests(engine)
        return PoolRestore(geom.name, layout, engine, geom.layers, geom.item_bytes, geom.page_size,
                           {path: f"{path}:{geom.name}" for path in ("hicache_backup", "hicache_load")}, snapshot)

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every digest submitted so far has been delivered (tests, tools; never
        the serving thread). False if one engine's collector did not get there in time."""
        with self._lock:
            engines = [p.engine for p in self._pools.values() if p is not None]
        done = []
        for engine in engines:
            reached = threading.Event()
            engine.post(lambda _arg, ev=reached: ev.set())
            done.append(reached)
        return all(ev.wait(timeout_s) for ev in done)

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            if pool is not None:
                try:
                    pool.engine.close()
                except Exception:
                    _log.exception("dsv4-idxk-probe hicache: closing a restore digest engine failed")

    # -- backup and load ----------------------------------------------------------

    def after_backup(self, state, host_indices, device_indices) -> None:
        """Digest the device pages a page-path backup read, on its stream, and keep them per
        host row. This thread derives the device page ids and launches the digest; the host
        rows are read from the held index tensor by the collector (`restore_rows`)."""
        nbytes = _moved_bytes(state, host_indices, state.geom.layers)
        pool = self._verified_pool(state, "hicache_backup", nbytes)
        if pool is None:
            return
        host, key, size = Captured(host_indices), state.key, pool.page_size

        def stored(result) -> None:
            rows = read_rows(host, size)
            if rows is None:  # the index tensor was rewritten: which rows it named is unknown
                self._count("hicache_backup", "unverified", "probe_error", nbytes)
                self.store.forget_all(key)  # never compare a load with a digest kept under a wrong row
                return
            if result.error or not result.contents or any(result.out_of_range):
                self._count("hicache_backup", "unverified", "probe_error", nbytes)
                self.store.drop(key, rows)  # never compare a load with a digest not taken
                return
            self.store.put(key, rows, result.contents[0])
            self._count("hicache_backup", "verified", "none", nbytes)

        self._submit(pool, device_page_ids(device_indices, size), stored, "hicache_backup", nbytes, key, host,
                     host_indices.numel() // size)

    def after_load(self, state, host_indices, device_indices, layer: int, context: dict) -> None:
        """After the pool's last layer of a page-path load: digest the device pages it wrote,
        on its stream, and compare them with their host rows' backups on the collector, which
        reads the host rows and device page numbers from the held tensors.
        `context`: what the report needs besides the comparison (global layer ids ...)."""
        if layer != state.geom.layers - 1:
            return  # the pages are complete once the last layer is loaded
        nbytes = _moved_bytes(state, host_indices, state.geom.layers)
        pool = self._verified_pool(state, "hicache_load", nbytes)
        if pool is None:
            return
        device_pages = device_page_ids(device_indices, pool.page_size)
        host, pages_of, key, size = Captured(host_indices), Captured(device_pages), state.key, pool.page_size

        def compared(result) -> None:
            rows, pages = read_rows(host, size), read_rows(pages_of, None)
            if rows is None or pages is None or result.error or not result.contents or any(result.out_of_range):
                self._count("hicache_load", "unverified", "probe_error", nbytes)
                return
            comparison = compare_load(self.store.get(key, rows), result.contents[0], rows, pages,
                                      pool.layout.segment_names)
            per_row = pool.row_bytes * pool.layers
            if comparison.verified_rows:
                self._count("hicache_load", "verified", "none", comparison.verified_rows * per_row)
            if comparison.unverified_rows:
                self._count("hicache_load", "unverified", "digest_lost", len(comparison.unverified_rows) * per_row)
            self._report(state, comparison, dict(context, pool=pool.name, layout=pool.layout.name,
                                                 host_rows=rows, device_pages=pages))

        self._submit(pool, device_pages, compared, "hicache_load", nbytes, key, host, host_indices.numel() // size)

    def _verified_pool(self, state, path: str, nbytes: int) -> PoolRestore | None:
        """The pool's restore set-up; None (an index-K pool's bytes counted unverified, with
        why) where this pool is not verified."""
        pool = self.pool(state)
        if pool is None and is_index_k_pool(state.geom.name):
            self._count(path, "unverified", self.why_not(state), nbytes)
        return pool

    def forget_rows(self, state, host_rows: list[int]) -> None:
        """The storage tier wrote these host pages: their kept digests no longer say what the
        rows hold (a later load of them is counted unverified, `digest_lost`). Dropped in the
        collector's order, behind the backups already submitted, whose digests it stores."""
        pool = self.pool(state)
        rows, key = [int(r) for r in host_rows], state.key
        if pool is None:
            self.store.drop(key, rows)
        else:
            pool.engine.post(lambda _arg: self.store.drop(key, rows))

    def write_sidecar(self, state, host_row: int, write: Callable[[np.ndarray], Any]) -> None:
        """The storage tier stored host row `host_row`: hand its kept digests to `write` (the
        backend's own set, under the sidecar key), in the collector's order, behind the backup
        that kept them. A row with no kept digest gets no sidecar (its L3 restore: digest_lost)."""
        pool = self.pool(state)
        if pool is None:
            return
        key, row = state.key, int(host_row)

        def store(_arg) -> None:
            (digests,) = self.store.get(key, [row])
            if digests is not None:
                write(encode_sidecar(digests))

        pool.engine.post(store)

    def storage_read(self, state, host_row: int, sidecar) -> bool:
        """The storage tier filled host row `host_row`; `sidecar`: the bytes stored beside the
        page, or None. With a sidecar of this pool's shape the row's digests are the ones its
        backup took, and its load is verified; without, they are lost. True when carried."""
        if not is_index_k_pool(state.geom.name):
            return False
        pool = self.pool(state)
        key, row = state.key, int(host_row)
        digests = None if pool is None or sidecar is None else decode_sidecar(
            sidecar, pool.layers, len(pool.layout.segments))
        nbytes = state.geom.layers * state.geom.item_bytes
        if digests is None:
            self.forget_rows(state, [row])
            self._count("l3", "unverified", "digest_lost", nbytes)
            return False
        pool.engine.post(lambda _arg: self.store.put(key, [row], digests[:, None, :]))
        self._count("l3", "verified", "none", nbytes)
        return True

    def _submit(self, pool: PoolRestore, device_pages, callback, path: str, nbytes: int, key: int,
                host: Captured, n_pages: int) -> None:
        n_tokens = n_pages * pool.layout.page_tokens
        if pool.snapshot is not None:  # a CPU pool: the pages copied now, digested on the collector
            ticket = pool.engine.backlog() < self.queue_max and pool.snapshot.submit(device_pages, n_pages, n_tokens,
                                                                                     callback)
        else:
            ticket = pool.engine.submit_room(pool.keys[path], device_pages, n_tokens, callback, contents_only=True)
        if not ticket:  # the collector is behind: counted, never waited for
            self._count(path, "unverified", "queue_full", nbytes)
            if path == "hicache_backup":
                self._drop_when_copied(pool, key, host)

    def _drop_when_copied(self, pool: PoolRestore, key: int, host: Captured) -> None:
        """Forget these host rows' kept digests (their backup was not digested). The rows
        are read by the collector; where the index tensor is on a device, once the stream
        has passed this point (an event recorded here, waited for there): this thread never
        waits. The rare path: a full queue."""
        copied = None
        if getattr(host.tensor, "is_cuda", False):
            import torch

            copied = torch.cuda.Event()
            copied.record()
        size = pool.page_size

        def drop(_arg) -> None:
            if copied is not None:
                copied.synchronize()
            rows = read_rows(host, size)
            if rows is None:
                self.store.forget_all(key)
            else:
                self.store.drop(key, rows)

        pool.engine.post(drop)


def _engine(layout: RowLayout, layer_ids: list[int], buffers: list, queue_max: int):
    from ..digest.engine import DigestEngine  # torch (and Triton on CUDA): only when a pool is verified

    return DigestEngine(layout, layer_ids, buffers, contents=True, max_pending=queue_max, prealloc=PREALLOC)


def _moved_bytes(state, host_indices, layers: int) -> int:
    """Index-K bytes a page-path copy moves: its pages, times the layers, times a row."""
    pages = int(host_indices.numel()) // max(1, state.geom.page_size)
    return pages * int(layers) * int(state.geom.item_bytes)
