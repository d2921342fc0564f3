"""Restore verification (on by default): every index-K page a load writes is compared
with what its backup read.

* **Backup** (`after_backup`, behind `backup_from_device_all_layer`): the device pages
  the backup read are digested on the caller's current stream, right behind the copy,
  so the digest reads what the copy read. The content digests of every (layer,
  segment) are kept per host row (`restore_store.HostPageDigests`, bounded).
* **Load** (`after_load`, behind `load_to_device_per_layer`): once a load has put in
  every layer of the pool (the last in SGLang's loop, whatever its id: a packed MTP
  draft layer is loaded first), the device pages the load wrote are digested on the same stream,
  so the digest reads what the load wrote; the collector compares them with the kept
  digests of their host rows (`restore_compare`). A difference is a finding at stage
  `hicache_load`, localised to (pool, layer, host row, device page, segment).

Nothing here waits for the device, and the copying thread does only what must happen
at that instant: it derives the device page ids on the indices' device (one division)
and launches the digest on its stream (digest/engine.py: one launch and one event; the
outputs' copy down is the collector's), holding a reference to the host index tensor
and its version counter. Everything else is the collector's: it reads the host rows
back from the held tensor (`restore_rows`), counts the bytes, stores or compares, and
reads the device page numbers only when a load differs from its backup. A load's
layers before the one that completes it cost a bit set (`HiCacheProbe.end` does not call in). Without
CUDA (the rig) the copying thread copies the pages instead and the collector digests
the copy with the NumPy reference (`restore_snapshot`). One engine (one collector
thread) per index-K host pool, so a model with several index-K pools has several
engines, each with its own layout.

Plain tensors and callbacks in; no SGLang.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..digest.collector import DEFER_ROUNDS
from ..digest.layout import DIGEST_VERSION, RowLayout, Segment, shipped_layouts
from ..safety import record_error
from ..vocabulary import HICACHE_STAGES
from .restore_compare import LoadComparison, compare_load
from .restore_rows import read_rows
from .restore_store import HostPageDigests
from .settings import RESTORE_RECORDS

_log = logging.getLogger("dsv4_idxk_probe.hicache")

STAGE = HICACHE_STAGES[0]  # "hicache_load"

#: A stored page's digests travel beside it under the page's storage key plus this suffix
#: (a sidecar key in the storage backend's own key space; docs/hicache.md, "The storage tier").
SIDECAR_SUFFIX = ".dsv4-idxk-digest"
#: First word of a sidecar, as a little-endian uint64: its format and the digest version of the
#: digests it holds ("dsv4idx2": digest version 1, "dsv4idx3": version 2; the first format,
#: "dsv4idxk", carried no page version), then layers, segments, the stored page's version
#: (VERSION_WORDS words), digests. Stored pages outlive the process that stored them: a sidecar
#: of another word (written by a probe of another digest version) reads as none, never as
#: digests to compare with this version's.
_SIDECAR_MAGIC_OF_DIGEST_VERSION = {1: b"dsv4idx2", 2: b"dsv4idx3"}
SIDECAR_MAGIC = int.from_bytes(_SIDECAR_MAGIC_OF_DIGEST_VERSION[DIGEST_VERSION], "little")
EARLIER_SIDECAR_HEAD = b"dsv4idxk"  # the first format's first word
#: Which stored page a sidecar describes, as the storage backend tells one file from another
#: (HiCacheFile: inode, its generation, size, modification time in ns): opaque integers here.
PageVersion = tuple[int, ...]
VERSION_WORDS = 4
_SIDECAR_HEADER = 3 + VERSION_WORDS  # words before the digests


def sidecar_bytes(layers: int, segments: int) -> int:
    return 8 * (_SIDECAR_HEADER + int(layers) * int(segments))


def encode_sidecar(digests: np.ndarray, page_version: PageVersion) -> np.ndarray:
    """A host row's kept digests (uint64 [layers, segments]) and the version of the stored page
    they describe, as the bytes of its sidecar."""
    if len(page_version) != VERSION_WORDS:
        raise ValueError(f"a page version has {VERSION_WORDS} words, got {len(page_version)}")
    layers, segments = digests.shape
    header = [SIDECAR_MAGIC, layers, segments, *(int(v) for v in page_version)]
    words = np.concatenate([np.array(header, dtype=np.uint64), np.asarray(digests, dtype=np.uint64).reshape(-1)])
    return words.view(np.uint8)


def decode_sidecar(data, layers: int, segments: int) -> tuple[np.ndarray, PageVersion] | None:
    """The digests a sidecar carries and the page version they describe, None when it is not
    a sidecar of this pool's shape (or of an earlier format)."""
    data = np.asarray(data, dtype=np.uint8).reshape(-1)
    if data.size != sidecar_bytes(layers, segments):
        return None
    words = data.view(np.uint64)
    if int(words[0]) != SIDECAR_MAGIC or (int(words[1]), int(words[2])) != (layers, segments):
        return None
    version = tuple(int(w) for w in words[3:_SIDECAR_HEADER])
    return words[_SIDECAR_HEADER:].reshape(layers, segments).copy(), version


#: Staging buffers (pinned host + device, 128 KiB each for a copy of up to ~130 pages x 30
#: layers) each pool's engine reserves at start-up: digests in flight at once before the
#: collector gives them back. One more is allocated on the copying thread (milliseconds).
PREALLOC = 16
#: `hicache.restore_record` in the engine's words (`digest.engine.RECORDS`): "copy", the
#: copying thread's record, is the engine's "submit".
_ENGINE_RECORD = {"collector": "collector", "copy": "submit"}
_UNKNOWN = object()  # a pool not looked up yet (`RestoreVerifier.pool` makes its set-up)


def is_index_k_pool(name: str) -> bool:
    """SGLang names its index-K host pools ``deepseek_v4_c{1,2,4}_indexer``: the pools whose
    bytes this verifies and counts. (Its ``draft_indexer`` is a DSA or QSA draft's; a
    DeepSeek-V4 draft layer is uncompressed and has no index-K: docs/coverage.md.)"""
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
    snapshot: Any = None  # restore_snapshot.SnapshotDigests: a CPU pool's copy-then-digest path
    # the engine reads a copy's token indices as they are (its `page_id_stride` is the page
    # size), so the copying thread launches no division for the page ids
    strided: bool = False
    # Plain attributes the copying thread reads, made once (no property call on its path):
    backup_key: str = field(init=False)  # the digest's room key of a backup, of a load
    load_key: str = field(init=False)
    page_tokens: int = field(init=False)  # token slots of one digest page (the layout's), as the engine counts
    page_bytes: int = field(init=False)  # index-K bytes of one host page, all layers

    def __post_init__(self):
        self.backup_key, self.load_key = f"hicache_backup:{self.name}", f"hicache_load:{self.name}"
        self.page_tokens = self.layout.page_tokens
        self.page_bytes = self.layers * self.row_bytes


class RestoreVerifier:
    """Backups digested and kept, loads digested and compared, for every index-K pool."""

    def __init__(self, max_pages: int, queue_max: int, report: Callable[[Any, LoadComparison, dict], None],
                 count: Callable[[str, str, str, int], None], on_evict: Callable[[int], None],
                 engine_factory: Callable[..., Any] | None = None, defer_s: float = 0.0,
                 record: str = "collector"):
        """`report(state, comparison, context)`: a load's comparison, on the collector thread.
        `count(path, outcome, reason, nbytes)`: coverage (ProbeMetrics.count_coverage).
        `defer_s`: how long each pool's collector waits for the copying thread to go quiet
        before it reads back, stores and compares (`hicache.restore_defer_ms`).
        `record`: where a digest's event is recorded (`hicache.restore_record`, `engine_options`)."""
        self.defer_s = defer_s
        self.record = record
        self.store = HostPageDigests(max_pages, on_evict, self._stored_lost)
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
        # the copying thread's loads of a restore and the backups after it are one busy
        # stretch: each collector waits until it ends (up to DEFER_ROUNDS sleeps of defer_s)
        engine = self._engine_factory(layout, list(range(geom.layers)), buffers, self.queue_max,
                                      defer_s=self.defer_s, defer_rounds=DEFER_ROUNDS,
                                      page_id_stride=max(1, int(geom.page_size)), **engine_options(self.record))
        snapshot = None
        if getattr(engine, "backend", None) == "reference":  # no GPU: digests would run on the copying thread
            from .restore_snapshot import SnapshotDigests

            snapshot = SnapshotDigests(engine)
        strided = snapshot is None and getattr(engine, "page_id_stride", 1) == geom.page_size
        return PoolRestore(geom.name, layout, engine, geom.layers, geom.item_bytes, geom.page_size, snapshot, strided)

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

    def forget_pool(self, key: int) -> None:
        """A pool that is gone (garbage-collected): its kept digests, its set-up and its engine
        go with it, so a pool made later at the same address (`id`) gets its own, never this
        one's, which reads the old pool's device buffers. Its collector is told to stop, not
        waited for (the caller may be any thread)."""
        self.store.forget_pool(key)
        with self._lock:
            pool = self._pools.pop(key, None)
            self._why_not.pop(key, None)
        if pool is not None:
            try:
                pool.engine.close(0)
            except Exception:
                record_error("hicache.restore_close")

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
        host row. This thread launches the digest over the copy's device token indices (the
        engine reads each page's first, `PoolRestore.strided`) and keeps the host index tensor with its
        version counter; the host rows and the bytes counted are worked out by the collector
        (`restore_rows`)."""
        pool = self._pools.get(state.key, _UNKNOWN)
        if pool is _UNKNOWN:
            pool = self.pool(state)
        if pool is None:
            self._not_verified(state, "hicache_backup", host_indices)
            return
        size = pool.page_size
        n_pages = host_indices.numel() // size
        # no frame of ours more on the copying thread: `restore_rows.held`, inline
        version = None if host_indices.is_inference() else host_indices._version
        if version is None:  # an inference tensor keeps no version counter: its rows copied now
            host_indices = host_indices.clone()
        key = state.key
        generation = self.store.generations.get(key, 0)  # its pool's fenced forgets so far

        def stored(result) -> None:
            nbytes = n_pages * pool.page_bytes
            rows = read_rows(host_indices, version, size)
            if rows is None:  # the index tensor was rewritten: which rows it named is unknown
                self._count("hicache_backup", "unverified", "probe_error", nbytes)
                self.store.forget_all(key)  # never compare a load with a digest kept under a wrong row
                return
            if result.error or not result.contents or any(result.out_of_range):
                self._count("hicache_backup", "unverified", "probe_error", nbytes)
                self.store.drop(key, rows)  # never compare a load with a digest not taken
                return
            if self.store.put(key, rows, result.contents[0], generation):
                self._count("hicache_backup", "verified", "none", nbytes)
            else:  # the pool's digests were forgotten meanwhile (a collector far behind, a token backup)
                self._count("hicache_backup", "unverified", self.store.fence_cause.get(key, "queue_full"), nbytes)

        try:
            if pool.strided:  # the engine reads the token indices as they are: no frame, no device call more
                ticket = pool.engine.submit_room(pool.backup_key, device_indices, n_pages * pool.page_tokens, stored,
                                                 contents_only=True)
            else:
                ticket = self._submit_page_ids(pool, pool.backup_key, device_indices, n_pages, stored)
        except Exception:  # the rows hold new bytes now: their old digests must go, as for a full queue
            record_error("hicache.restore_backup")
            self._count("hicache_backup", "unverified", "probe_error", n_pages * pool.page_bytes)
            self._drop_when_copied(pool, key, host_indices, version)
            return
        if not ticket:  # the collector is behind: counted, never waited for
            self._count("hicache_backup", "unverified", "queue_full", n_pages * pool.page_bytes)
            self._drop_when_copied(pool, key, host_indices, version)

    def after_load(self, state, host_indices, device_indices, context: dict) -> None:
        """Once a page-path load has put in every layer of the pool (`HiCacheProbe.end` calls
        with the layer that completes it, in whatever order the layers came): digest the
        device pages it wrote, on its stream, and compare them with their host rows' backups
        on the collector, which reads the host rows from the held tensor (and the device page
        numbers, only when a row differs). `context`: what the report needs besides the comparison."""
        pool = self._pools.get(state.key, _UNKNOWN)
        if pool is _UNKNOWN:
            pool = self.pool(state)
        if pool is None:
            self._not_verified(state, "hicache_load", host_indices)
            return
        size = pool.page_size
        n_pages = host_indices.numel() // size
        # `restore_rows.held`, inline: an inference tensor (no version counter) is copied now
        version = None if host_indices.is_inference() else host_indices._version
        device_version = None if device_indices.is_inference() else device_indices._version
        if version is None:
            host_indices = host_indices.clone()
        device_rows = device_indices.clone() if device_version is None else device_indices
        key = state.key

        def compared(result) -> None:
            rows = read_rows(host_indices, version, size)
            if rows is None or result.error or not result.contents or any(result.out_of_range):
                self._count("hicache_load", "unverified", "probe_error", n_pages * pool.page_bytes)
                return
            expected, contents, names = self.store.get(key, rows), result.contents[0], pool.layout.segment_names
            comparison = compare_load(expected, contents, rows, None, names)
            device_pages = None
            if comparison.mismatch_rows:  # a finding names its device pages: read them now
                device_pages = read_rows(device_rows, device_version, size)
                if device_pages is not None:  # else rewritten since: the finding names host rows only
                    comparison = compare_load(expected, contents, rows, device_pages, names)
            if comparison.verified_rows:
                self._count("hicache_load", "verified", "none", comparison.verified_rows * pool.page_bytes)
                unverified = set(comparison.unverified_rows)
                from_l3 = self.store.take_stored(key, [r for r in rows if r not in unverified])
                if from_l3:  # storage-tier pages whose digests this load compared
                    self._count("l3", "verified", "none", from_l3 * pool.page_bytes)
            if comparison.unverified_rows:
                self._count("hicache_load", "unverified", "digest_lost",
                            len(comparison.unverified_rows) * pool.page_bytes)
            self._report(state, comparison, dict(context, pool=pool.name, layout=pool.layout.name,
                                                 host_rows=rows, device_pages=device_pages))

        try:
            if pool.strided:
                ticket = pool.engine.submit_room(pool.load_key, device_indices, n_pages * pool.page_tokens, compared,
                                                 contents_only=True)
            else:
                ticket = self._submit_page_ids(pool, pool.load_key, device_indices, n_pages, compared)
        except Exception:  # not digested: counted, as a backup's failed submit is
            record_error("hicache.restore_load")
            self._count("hicache_load", "unverified", "probe_error", n_pages * pool.page_bytes)
            return
        if not ticket:  # the collector is behind: counted, never waited for
            self._count("hicache_load", "unverified", "queue_full", n_pages * pool.page_bytes)

    def forget_all_rows(self, state) -> None:
        """Host rows of an index-K pool were written, and which ones cannot be told here: a
        token-granular backup wrote parts of rows through a kernel whose row geometry need not
        be this pool's (docs/hicache.md), or a writer the wrappers do not see named its rows
        in a device tensor (a PD host receive). Kept digests no longer say what those rows
        hold, and a page-path load of one would be compared with them, a mismatch nobody
        made. All the pool's kept digests go, fenced (those of backups still in flight too):
        rare copies; the loads after count `digest_lost`."""
        self.store.forget_all(state.key, fence=True, cause="other")

    def _submit_page_ids(self, pool: PoolRestore, key: str, device_indices, n_pages: int, callback):
        """Digest the device pages a copy named, in its stream order, where the engine does not
        read the token indices itself (`PoolRestore.strided`: a CPU pool's snapshot, an
        engine of another stride): this thread derives the page ids as the pool does (first
        index of each page over the page size: one strided view and one division on the
        indices' device, no read-back). The ticket, or a false value when the collector is behind."""
        size = pool.page_size
        pages = device_indices[::size].floor_divide(size)
        if pool.snapshot is None:
            return pool.engine.submit_room(key, pages, n_pages * pool.page_tokens, callback, contents_only=True)
        return self._snapshot(pool, pages, n_pages, callback)

    def _not_verified(self, state, path: str, host_indices) -> None:
        """An index-K pool that is not verified: its bytes counted unverified, with why."""
        if is_index_k_pool(state.geom.name):
            self._count(path, "unverified", self.why_not(state), _moved_bytes(state, host_indices, state.geom.layers))

    def forget_rows(self, state, host_rows: list[int]) -> None:
        """The storage tier wrote these host pages: their kept digests no longer say what the
        rows hold (a later load of them is counted unverified, `digest_lost`). Dropped in the
        collector's order, behind the backups already submitted, whose digests it stores."""
        pool = self.pool(state)
        rows, key = [int(r) for r in host_rows], state.key
        if pool is None:
            self.store.drop(key, rows)
        elif self._far_behind(pool):  # notes stay bounded: all of the pool's digests go, fenced
            self.store.forget_all(key, fence=True)
        else:
            pool.engine.post(lambda _arg: self.store.drop(key, rows))

    def write_sidecar(self, state, host_row: int, page_version: PageVersion,
                      write: Callable[[np.ndarray], Any]) -> None:
        """The storage tier stored host row `host_row` as the page at `page_version`: hand its
        kept digests, tied to that version, to `write` (the backend's own set, under the
        sidecar key), in the collector's order, behind the backup that kept them. A row with
        no kept digest gets no sidecar (its L3 restore: digest_lost)."""
        pool = self.pool(state)
        if pool is None or self._far_behind(pool):  # none written: the page's restore counts digest_lost
            return
        key, row = state.key, int(host_row)

        def store(_arg) -> None:
            (digests,) = self.store.get(key, [row])
            if digests is not None:
                write(encode_sidecar(digests, page_version))

        pool.engine.post(store)

    def generation(self, state) -> int:
        """The pool's fences so far: taken before a storage read, for `storage_read`."""
        return self.store.generations.get(state.key, 0)

    def storage_read(self, state, host_row: int, sidecar, page_version: PageVersion | None, generation: int) -> bool:
        """The storage tier filled host row `host_row` from the stored page at `page_version`;
        `sidecar`: the bytes stored beside the page, or None. A sidecar of this pool's shape
        that describes that very page gives the row the digests its backup took, and its load
        is verified; otherwise they are lost (a sidecar of another version describes a page
        stored before this one: comparing with it would report bytes nobody corrupted).
        `generation`: the pool's (`generation`) before the read began, so that a fence during
        the read (a token backup writing into the row) refuses the digests too. True when
        carried."""
        if not is_index_k_pool(state.geom.name):
            return False
        pool = self.pool(state)
        key, row = state.key, int(host_row)
        carried = None if pool is None or sidecar is None else decode_sidecar(
            sidecar, pool.layers, len(pool.layout.segments))
        nbytes = state.geom.layers * state.geom.item_bytes
        if carried is None or carried[1] != page_version or self._far_behind(pool):
            self.forget_rows(state, [row])
            self._count("l3", "unverified", "digest_lost" if pool is not None else self.why_not(state), nbytes)
            return False
        digests = carried[0]

        def keep(_arg) -> None:
            # counted on l3 once a load compares the page (`compared`), or unverified should its
            # entry go first (`_stored_lost`) or be refused: a page read is not yet a page verified
            if not self.store.put(key, [row], digests[:, None, :], generation, stored=True):
                self._count("l3", "unverified", "digest_lost", nbytes)

        pool.engine.post(keep)
        return True

    def _stored_lost(self, key: int, n_rows: int) -> None:
        """Storage-tier pages whose digests went (evicted, dropped, backed up over) before a
        load compared them: read from L3, never verified."""
        pool = self._pools.get(key)
        if pool is not None:
            self._count("l3", "unverified", "digest_lost", n_rows * pool.page_bytes)

    def _far_behind(self, pool: PoolRestore) -> bool:
        """Whether the pool's collector has `2 x queue_max` batches and notes waiting: past
        that, nothing more is posted to it (its notes would grow without bound)."""
        return pool.engine.backlog() >= 2 * self.queue_max

    def _snapshot(self, pool: PoolRestore, pages, n_pages: int, callback) -> bool:
        """A CPU pool: the pages copied now, digested on the collector; False when it is behind."""
        return pool.engine.backlog() < self.queue_max and pool.snapshot.submit(
            pages, n_pages, n_pages * pool.page_tokens, callback)

    def _drop_when_copied(self, pool: PoolRestore, key: int, host, version: int | None) -> None:
        """Forget these host rows' kept digests (their backup was not digested). The rows
        are read by the collector; where the index tensor is on a device, once the stream
        has passed this point (an event recorded here, waited for there): this thread never
        waits. The rare path: a full queue. Past `2 x queue_max` batches and notes waiting (a
        collector far behind, or stopped), the pool's digests are all forgotten here instead,
        fenced so that none submitted before is stored: the notes stay bounded."""
        if self._far_behind(pool):
            self.store.forget_all(key, fence=True)
            return
        copied = None
        if getattr(host, "is_cuda", False):
            import torch

            try:
                copied = torch.cuda.Event()
                copied.record()
            except Exception:  # which rows cannot be read in order now: forget them all
                record_error("hicache.restore_drop")
                self.store.forget_all(key, fence=True)
                return
        size = pool.page_size

        def drop(_arg) -> None:
            if copied is not None:
                copied.synchronize()
            rows = read_rows(host, version, size)
            if rows is None:
                self.store.forget_all(key)
            else:
                self.store.drop(key, rows)

        pool.engine.post(drop)


def engine_options(record: str = "collector") -> dict:
    """How each index-K pool's digest engine is built (`_engine`; the benches build theirs
    alike): content digests, staging reserved at start-up, the outputs copied down by the
    collector, and the collector's deferral before its first device call, so it makes none
    during a burst of copies. `record` (`hicache.restore_record`): "collector" records the
    batch's event on the collector too (on the copy's stream, behind the kernel and the
    copies queued since), so a submit is one launch on the copying thread; right where
    copies run on streams of their own, as SGLang's do (the event then waits for more
    copies, never a forward; docs/hicache.md). "copy" records it on the copying thread
    behind the launch (one device call more): for a fork that copies on the forward's
    stream, where the collector's event would land behind the next forward."""
    try:
        engine_record = _ENGINE_RECORD[record]
    except KeyError:
        raise ValueError(f"record must be one of {RESTORE_RECORDS}, got {record!r}") from None
    return {"contents": True, "prealloc": PREALLOC, "download": "collector", "record": engine_record,
            "defer_at": "first_call"}


def _engine(layout: RowLayout, layer_ids: list[int], buffers: list, queue_max: int, **options):
    """A pool's restore digest engine; `options`: what `RestoreVerifier` sets per pool
    (`engine_options`, the deferral, the page-id stride), checked by the engine's constructor."""
    from ..digest.engine import DigestEngine  # torch (and Triton on CUDA): only when a pool is verified

    return DigestEngine(layout, layer_ids, buffers, max_pending=queue_max, **options)


def _moved_bytes(state, host_indices, layers: int) -> int:
    """Index-K bytes a page-path copy moves: its pages, times the layers, times a row."""
    pages = int(host_indices.numel()) // max(1, state.geom.page_size)
    return pages * int(layers) * int(state.geom.item_bytes)
