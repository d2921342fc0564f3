"""The HiCache host-pool probe: per-pool state, per-call accounting, reports.

Adapters hand in plain facts (a `PoolGeometry`, row views, index tensors,
sizes); this object counts branches, pages and tokens, applies the geometry
guard, queues index checks for the flusher and drives round-trip mode. It
never imports SGLang.

A copy call does host-side arithmetic on plain integers (branch, page and
token counts live in per-pool dicts) and, on the page path, queues its index
tensors for the flusher's checks; nothing waits for the device unless
round-trip mode is on. The flusher thread publishes the counts to Prometheus every
``flush_interval_s`` (and `publish` does it on demand), which keeps the
metric library's locks off the copy path.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import traceback
import weakref
from collections import deque
from typing import Any, Callable

from ..vocabulary import SCHEMA_VERSION  # one room-log schema for every record kind
from .branches import DIRECTIONS, MOVING, NO_IO_BACKEND, classify, label_sets, moved
from .geometry import INVARIANTS, PoolGeometry, describe, invariant_failures, token_row_mismatches
from .indexcheck import CHECK_LABELS, CheckSlot, Flusher, IndexChecker
from ..diagnosis.journal import PageGroups
from .culprit import describe as describe_culprit, merge as merge_checks, record as culprit_record
from .roundtrip import LEG_NAMES, LEGS, VERDICTS, RoundTrip, RowViews
from .restore import STAGE as RESTORE_STAGE, RestoreVerifier, is_index_k_pool
from .restore_compare import LoadComparison
from ..vocabulary import VERDICTS as ROOM_VERDICTS
from .settings import HiCacheSettings, settings_from_config
from ..safety import record_error, safe_invoke

_log = logging.getLogger("dsv4_idxk_probe.hicache")
#: Cells (and diagnosed device pages) one `restore_mismatch` record lists; the rest are counted.
MAX_RESTORE_CELLS = 256
_NO_CONTEXT: dict = {}  # a load's report context from the copy path: nothing beyond the comparison (never written)


class GuardRefused(RuntimeError):
    """Raised into the caller only with ``hicache.guard: block``: a token-granular
    copy on a pool whose rows are not the row the token kernel writes."""


class PoolState:
    """What the probe keeps per host pool: geometry, metric children, check slots."""

    def __init__(self, key: int, geom: PoolGeometry, views: RowViews | None, io_backends):
        self.key = key
        self.geom = geom
        self.views = views
        self.page_branches = {io: geom.page_branch(io) for io in io_backends}
        # counted on the copy path, published by the flusher
        self.counts: dict[tuple[str, str, str], int] = {}
        self.moved = {direction: [0, 0] for direction in DIRECTIONS}  # pages, tokens
        self._published: dict[Any, int] = {}
        self.copies: dict[tuple[str, str, str], Any] = {}
        self.pages: dict[str, Any] = {}
        self.tokens: dict[str, Any] = {}
        self.slots: dict[str, CheckSlot] = {}
        self.guard_reasons = token_row_mismatches(geom) if geom.token_path_eligible else []
        self.guard_seen = 0
        self.invariants_failed: dict[str, str] = {}
        self.last_load: tuple | None = None  # index tensors of the last checked load
        # round trip: (host, device index tensors, host row -> checks) of the load the
        # journal last recorded, so its later layers add their checks to the same event
        self.load_checks: tuple | None = None
        # the model's (global) layer id of each of the pool's layers, once known (`layer_ids`)
        self.layer_ids: tuple[int, ...] | None = None
        # restore verification: the pool layers the load in progress has put in, a bit each. Its
        # pages are complete once every layer is in, in whatever order they came: SGLang loads a
        # layer packed after the target layers (an MTP draft layer) at the series' first step. A
        # layer put in twice starts the next load (the one before stopped short).
        self.load_layers = 0
        self.all_layers = (1 << geom.layers) - 1
        self._host_arrays: list | None = None

    def host_arrays(self) -> list:
        """Each layer's host rows as NumPy arrays [rows, item_bytes] (views, made once): a host
        row read on the CPU (an L3 write's check) without torch's cost per call."""
        if self._host_arrays is None:
            self._host_arrays = [self.views.host_layer(layer).numpy() for layer in range(self.geom.layers)]
        return self._host_arrays


class Call:
    """One wrapped copy between `begin` and `end`."""

    __slots__ = ("state", "direction", "branch", "numel", "layer", "host", "device", "refusal", "roundtrip", "checks")

    def __init__(self, state, direction, branch, numel, layer, host, device):
        self.state = state
        self.direction = direction
        self.branch = branch
        self.numel = numel
        self.layer = layer  # the layer of a per-layer load; None: all layers
        self.host = host
        self.device = device
        self.refusal: str | None = None
        self.roundtrip = None
        self.checks: dict | None = None  # round trip, loads: host row -> what its checks found


class HiCacheProbe:
    """One per probe runtime; shared by every host-pool wrapper."""

    def __init__(self, metrics, settings: HiCacheSettings, emit: Callable[[dict], None] | None = None, log=None,
                 journal=None, layer_source: Callable[[], dict[int, int]] | None = None):
        """`layer_source`: the model's index-K buffers by data pointer -> global layer id (the PD
        sides know them); a host pool whose device buffers are those is named by global layer
        ids in records and log lines, as `diff` names layers. Other pools keep their own index."""
        self.metrics = metrics
        self._layer_source = layer_source
        self.journal = journal  # diagnosis.PageJournal: backups and loads are page events (docs/diagnosis.md)
        self.settings = settings
        self.active = settings.enabled
        self.log = log or _log
        self._emit = emit
        self.local = threading.local()  # adapters mark nested calls here
        self._pools: dict[int, PoolState] = {}
        self.unusable: dict[int, str] = {}  # id(pool) -> why it could not be registered (tried once)
        self._retired: list[PoolState] = []  # garbage-collected pools with counts still to publish
        self._dead: deque[tuple[int, PoolState]] = deque()  # pools finalized, not retired yet (`_retire_dead`)
        self._lock = threading.Lock()
        self.checker = (
            IndexChecker(self._on_violations, self._on_index_drop, settings.index_queue_max)
            if settings.index_checks
            else None
        )
        self.flusher: Flusher | None = None
        self.roundtrip = (
            RoundTrip(self._on_roundtrip, self._on_roundtrip_evict, settings.roundtrip_max_entries)
            if settings.roundtrip
            else None
        )
        # restore verification (docs/hicache.md): on by default, never waits for the device
        self.restore = (
            RestoreVerifier(settings.restore_max_pages, settings.restore_queue_max, self._on_restore,
                            self._count_on_copy_path, self._on_restore_evict,
                            defer_s=settings.restore_defer_ms / 1000, record=settings.restore_record)
            if settings.restore_verify
            else None
        )
        # coverage counted on the copy path (bytes the collector never saw), published by the flusher
        self._coverage: dict[tuple[str, str, str], int] = {}
        self._coverage_published: dict[tuple[str, str, str], int] = {}
        self._coverage_lock = threading.Lock()  # the copy threads and the collectors add, the flusher reads

    # -- pools --------------------------------------------------------------------

    def state_of(self, pool: Any) -> PoolState | None:
        if self._dead:  # a pool at this address may be a new one: the dead one's state goes first
            self._retire_dead()
        return self._pools.get(id(pool))

    def register(self, pool: Any, geom: PoolGeometry, views: RowViews | None) -> PoolState:
        """Record a pool once: zero series, info metric, invariants, one log line."""
        if self._dead:
            self._retire_dead()
        with self._lock:
            state = self._pools.get(id(pool))
            if state is not None:
                return state
            state = PoolState(id(pool), geom, views, self.settings.io_backends)
            self._pools[id(pool)] = state
        try:  # the finalizer only queues the pool: see `_retire_dead`
            weakref.finalize(pool, self._dead.append, (id(pool), state))
        except TypeError:
            pass  # not weak-referenceable: kept for the process lifetime
        self._create_series(state)
        self._check_invariants(state)
        if self.restore is not None and is_index_k_pool(geom.name):
            safe_invoke("hicache.restore", self._restore_series, state)
        if self.checker is not None:
            limits = (geom.host_pages * geom.page_size, geom.device_rows * geom.page_size)
            for direction in DIRECTIONS:
                state.slots[direction] = self.checker.add_slot(geom.name, direction, geom.page_size, *limits)
        self._start_flusher()
        line = describe(geom)
        self.log.info(
            "dsv4-idxk-probe hicache pool %s: layers=%d item_bytes=%d page_size=%d host_pages=%d layout=%s "
            "page_aligned_only=%s device=%s %s token_path_eligible=%s token_row_matches=%s",
            line["pool"], line["layers"], line["item_bytes"], line["page_size"], line["host_pages"],
            line["layout"], line["page_aligned_only"], line["device_shape"], line["device_dtype"],
            line["token_path_eligible"], line["token_row_matches"],
        )  # fmt: skip
        self.emit({"event": "pool", **line, "invariants_failed": dict(state.invariants_failed)})
        return state

    def _retire_dead(self) -> None:
        """Retire the pools that were garbage-collected. Their finalizer only queued them
        (`_dead`): the cyclic collector runs finalizers at any allocation, on any thread,
        also one that holds a lock this takes (the store's, this probe's), which would then
        wait for itself. Called before a pool is looked up or registered (a new pool may
        have the dead one's address) and by the flusher."""
        while self._dead:
            try:
                key, state = self._dead.popleft()
            except IndexError:  # another thread took the last one
                return
            with self._lock:
                if self._pools.get(key) is not state:
                    continue
                del self._pools[key]
                state._host_arrays = None  # views of the pool's host memory: it goes with the pool
                self._retired.append(state)
            if self.restore is not None:
                self.restore.forget_pool(key)  # its rows' digests and its engine go with it

    def _create_series(self, state: PoolState) -> None:
        m, geom, pool = self.metrics, state.geom, state.geom.name
        for key in label_sets(geom, self.settings.io_backends):
            state.counts[key] = 0
            state.copies[key] = self._copies_child(state, key)
        for direction in DIRECTIONS:
            state.pages[direction] = m.hicache_pages.labels(pool=pool, direction=direction)
            state.tokens[direction] = m.hicache_tokens.labels(pool=pool, direction=direction)
            if self.checker is not None:
                for check in CHECK_LABELS:
                    m.hicache_index_violations.labels(pool=pool, direction=direction, check=check)
        if state.guard_reasons:
            m.hicache_guard.labels(pool=pool, action=self._guard_action())
        if self.roundtrip is not None:
            for leg in LEGS:
                for verdict in VERDICTS:
                    m.hicache_roundtrip.labels(pool=pool, leg=leg, verdict=verdict)
        m.hicache_pool_info.labels(
            pool=pool,
            layout=geom.layout,
            page_aligned_only=str(geom.page_aligned_only).lower(),
            token_path_eligible=str(geom.token_path_eligible).lower(),
        ).set(1)
        for invariant in INVARIANTS:
            m.hicache_invariant_violations.labels(pool=pool, invariant=invariant)

    def _restore_series(self, state: PoolState) -> None:
        """An index-K pool: its restore engine (built now, at start-up, not on the first copy)
        and its series at zero: load verdicts, cells per segment, coverage, evictions."""
        m = self.metrics
        pool = self.restore.pool(state)
        for verdict in ROOM_VERDICTS:
            m.rooms_verified.labels(stage=RESTORE_STAGE, verdict=verdict)
        if pool is not None:
            for segment in pool.layout.segment_names:
                m.mismatch_cells.labels(stage=RESTORE_STAGE, segment=segment)
        for path in ("hicache_backup", "hicache_load"):
            m.coverage_bytes.labels(path=path, outcome="verified", reason="none")
        m.records_dropped.labels(sink="hicache_restore")
        if pool is None:
            self.log.warning("dsv4-idxk-probe hicache pool %s: restores not verified (rows cannot be digested: %s); "
                             "its copies are counted unverified", state.geom.name,
                             ", ".join(state.invariants_failed) or "no device layer views")

    def _check_invariants(self, state: PoolState) -> None:
        state.invariants_failed = invariant_failures(state.geom)
        for invariant, detail in state.invariants_failed.items():
            self.metrics.hicache_invariant_violations.labels(pool=state.geom.name, invariant=invariant).inc()
            self.log.warning("dsv4-idxk-probe hicache pool %s: invariant %s failed: %s", state.geom.name, invariant, detail)

    def _copies_child(self, state: PoolState, key: tuple[str, str, str]):
        direction, io_backend, branch = key
        return self.metrics.hicache_copies.labels(
            pool=state.geom.name, direction=direction, io_backend=io_backend, layout=state.geom.layout, branch=branch
        )

    def _start_flusher(self) -> None:
        with self._lock:
            if self.flusher is None:
                self.flusher = Flusher(self.flush, self.settings.flush_interval_s).start()

    def flush(self) -> None:
        """What the flusher does: retire collected pools, publish the counts, run the queued
        index checks."""
        if self._dead:
            safe_invoke("hicache.retire", self._retire_dead)
        safe_invoke("hicache.publish", self.publish)
        if self.checker is not None:
            self.checker.flush()

    def publish(self) -> None:
        """Add what the copy path counted since the last publish to the metrics."""
        deltas = []
        with self._coverage_lock:  # two publishers (the flusher, a caller) never count a delta twice
            for key, n in self._coverage.items():
                delta = n - self._coverage_published.get(key, 0)
                if delta:
                    deltas.append((key, delta))
                    self._coverage_published[key] = n
        for key, delta in deltas:
            self.metrics.count_coverage(*key, delta)
        with self._lock:
            states = list(self._pools.values()) + self._retired
            self._retired = []
        for state in states:
            with self._lock:
                for key, n in list(state.counts.items()):
                    delta = n - state._published.get(key, 0)
                    if delta:
                        child = state.copies.get(key) or state.copies.setdefault(key, self._copies_child(state, key))
                        child.inc(delta)
                        state._published[key] = n
                for direction, (pages, tokens) in list(state.moved.items()):
                    for unit, n, children in (("pages", pages, state.pages), ("tokens", tokens, state.tokens)):
                        delta = n - state._published.get((direction, unit), 0)
                        if delta:
                            children[direction].inc(delta)
                            state._published[(direction, unit)] = n

    def close(self) -> None:
        """Stop the flusher after a last flush (tests, shutdown)."""
        with self._lock:
            flusher, self.flusher = self.flusher, None
        if flusher is not None:
            flusher.stop()
        else:
            self.flush()
        if self.restore is not None:
            self.restore.close()
            self.publish()

    # -- per call -----------------------------------------------------------------

    def begin(self, state: PoolState, direction: str, host, device, io_backend: str | None, layer: int | None = None) -> Call:
        """Count the branch; decide the guard; round-trip digests before the copy.

        `io_backend` None marks the token-only backup; `layer` marks a per-layer load."""
        host_n = None if host is None else host.numel()
        device_n = None if device is None else device.numel()
        branch = classify(state.geom, host_n, device_n, io_backend, state.page_branches)
        key = (direction, io_backend or NO_IO_BACKEND, branch)
        counts = state.counts
        counts[key] = counts.get(key, 0) + 1  # one writer (the thread that copies); published by the flusher
        call = Call(state, direction, branch, host_n or 0, layer, host, device)
        if branch == "token_dsv4_mla" and state.guard_reasons:
            call.refusal = self._guard(state, direction, host_n)
        if self.roundtrip is not None and branch == "page" and not state.invariants_failed and state.views:
            call.roundtrip = safe_invoke("hicache.roundtrip", self._roundtrip_before, call)
        return call

    def end(self, call: Call, ok: bool) -> None:
        """Pages and tokens moved; queue the index check; round-trip after the copy."""
        state, branch = call.state, call.branch
        if ok and branch in MOVING:
            layers = state.geom.layers if call.layer is None else 1
            pages, tokens = moved(state.geom, branch, call.numel, layers)
            totals = state.moved[call.direction]
            totals[0] += pages
            totals[1] += tokens
        if branch == "page" and self.checker is not None:
            self._submit_indices(call)
        if ok and call.roundtrip is not None:
            safe_invoke("hicache.roundtrip", self._roundtrip_after, call)
        if ok and branch == "page" and self.journal is not None:
            safe_invoke("hicache.journal", self._journal_event, call)
        if ok and call.checks:
            safe_invoke("hicache.roundtrip", self._diagnose_load, call)
        restore = self.restore
        if ok and restore is not None and branch in MOVING:
            # Restore verification's common calls made straight from here (no frame of ours
            # in between): a page-path backup, the layer that completes a load; a load's other
            # layers only mark themselves in. A failure is counted as `safe_invoke` counts it.
            try:
                if branch != "page":
                    self._restore_token_copy(call)
                elif call.layer is None:
                    if call.direction == "d2h":
                        restore.after_backup(state, call.host, call.device)
                else:
                    bit, seen = 1 << call.layer, state.load_layers
                    seen = bit if seen & bit else seen | bit
                    if seen == state.all_layers:
                        state.load_layers = 0
                        restore.after_load(state, call.host, call.device, _NO_CONTEXT)
                    else:
                        state.load_layers = seen
            except Exception:
                record_error("hicache.restore")

    def layer_id(self, state: PoolState, layer: int | None) -> int | None:
        """The global layer id of the pool's layer `layer` (what the PD records and `diff` call
        it); the pool's own index while the pool's buffers are not known to be the model's."""
        if layer is None:
            return None
        ids = state.layer_ids
        if ids is None and self._layer_source is not None and state.views is not None:
            ids = state.layer_ids = _global_layer_ids(state, self._layer_source)
        return ids[layer] if ids is not None and 0 <= layer < len(ids) else layer

    def _journal_event(self, call: Call) -> None:
        """A backup from device pages, or a load into them (recorded once per load: at its
        first layer), naming the host rows; O(1): the index tensors are held, not read.
        In round-trip mode each later layer of the load adds its checks to that event."""
        state, size = call.state, call.state.geom.page_size
        if call.layer:  # a later layer of a load
            kept = state.load_checks
            if call.checks and kept is not None and kept[0] is call.host and kept[1] is call.device:
                merge_checks(kept[2], call.checks, self.layer_id(state, call.layer))
            return
        kind = "hicache_backup" if call.direction == "d2h" else "hicache_load"
        detail = {"pool": state.geom.name}
        if call.checks:
            merged: dict[int, dict] = {}
            merge_checks(merged, call.checks, self.layer_id(state, call.layer))
            detail["host_rows"] = merged
            state.load_checks = (call.host, call.device, merged)
        self.journal.record(kind, PageGroups(call.device, size), host_rows=PageGroups(call.host, size),
                            layer=self.layer_id(state, call.layer), detail=detail)

    def _diagnose_load(self, call: Call) -> None:
        """Round trip, after one layer of a load: for each host row it found broken, a
        `roundtrip_diagnosis` record naming the device page it went to and that page's
        journal events, the last of them this load (docs/diagnosis.md)."""
        host_rows, device_rows = call.roundtrip[0], call.roundtrip[1]
        device_of = dict(zip(host_rows, device_rows))
        for row, checks in call.checks.items():
            if "mismatch" not in checks.values():
                continue
            page = device_of.get(row)
            events = self.journal.events_for(page) if self.journal is not None and page is not None else []
            # page ids are shared by the DeepSeek-V4 sub-pools: keep this pool's copies and the PD events
            events = [e for e in events if e.get("pool") in (None, call.state.geom.name)]
            events = copy.deepcopy(events)  # the load's checks still grow with its later layers
            diag = culprit_record(call.state.geom.name, row, page, self.layer_id(call.state, call.layer), checks, events)
            diag["pool_layer"] = call.layer
            self.log.error("dsv4-idxk-probe hicache round trip: %s", describe_culprit(diag))
            self.emit(diag)

    def _submit_indices(self, call: Call) -> None:
        state = call.state
        if call.direction == "h2d":
            # A load runs once per layer with the same index tensors: check them once.
            last = state.last_load
            if last is not None and last[0] is call.host and last[1] is call.device:
                return
            state.last_load = (call.host, call.device)
        self.checker.submit(state.slots[call.direction], call.host, call.device)

    # -- guard --------------------------------------------------------------------

    def _guard_action(self) -> str:
        return "blocked" if self.settings.guard == "block" else "observed"

    def _guard(self, state: PoolState, direction: str, tokens: int | None) -> str | None:
        action = self._guard_action()
        geom = state.geom
        self.metrics.hicache_guard.labels(pool=geom.name, action=action).inc()
        state.guard_seen += 1
        row = geom.token_row
        message = (
            f"token-granular copy ({direction}, {tokens} indices) on host pool {geom.name!r}, whose rows are not "
            f"the {row.page_bytes}-byte row of {row.slots} x ({row.value_bytes} B value + {row.scale_bytes} B scale) "
            f"that the token kernel writes: {'; '.join(state.guard_reasons)}"
        )
        if state.guard_seen <= self.settings.guard_stack_logs:
            stack = "".join(traceback.format_stack(limit=24)[:-2])
            self.log.error("dsv4-idxk-probe hicache guard (%s): %s\n%s", action, message, stack)
            self.emit({"event": "guard", "pool": geom.name, "action": action, "direction": direction,
                       "tokens": tokens, "reasons": list(state.guard_reasons), "stack": stack})  # fmt: skip
        if action == "blocked":
            return f"dsv4-idxk-probe refused a {message} (hicache.guard is 'block')"
        return None

    # -- reports from the flusher and round-trip mode --------------------------------

    def emit(self, record: dict) -> None:
        if self._emit is not None:
            safe_invoke("hicache.emit", self._emit, {"v": SCHEMA_VERSION, "kind": "hicache", "time": time.time(), **record})

    def _on_violations(self, slot: CheckSlot, counts: dict[str, int]) -> None:
        for check, n in counts.items():
            self.metrics.hicache_index_violations.labels(pool=slot.pool, direction=slot.direction, check=check).inc(n)
        self.log.warning(
            "dsv4-idxk-probe hicache pool %s %s: index groups that are not whole, aligned, in-range pages: %s",
            slot.pool, slot.direction, counts,
        )  # fmt: skip
        self.emit({"event": "index_violations", "pool": slot.pool, "direction": slot.direction, "counts": counts})

    def _on_index_drop(self, n: int) -> None:
        self.metrics.records_dropped.labels(sink="hicache_index_checks").inc(n)

    def _on_roundtrip_evict(self, n: int) -> None:
        self.metrics.records_dropped.labels(sink="hicache_roundtrip").inc(n)

    def _on_roundtrip(self, state: PoolState, leg: str, counts: dict[str, int], mismatches: list[dict]) -> None:
        for verdict, n in counts.items():
            if n:
                self.metrics.hicache_roundtrip.labels(pool=state.geom.name, leg=leg, verdict=verdict).inc(n)
        for cell in mismatches:
            cell = dict(cell, layer=self.layer_id(state, cell["layer"]), pool_layer=cell["layer"])
            self.log.error(
                "dsv4-idxk-probe hicache round trip: pool %s host row %d layer %d (device row %d) differs after the %s",
                state.geom.name, cell["host_row"], cell["layer"], cell["device_row"], LEG_NAMES[leg],
            )  # fmt: skip
            self.emit({"event": "roundtrip_mismatch", "pool": state.geom.name, "leg": leg,
                       "leg_name": LEG_NAMES[leg], **cell})  # fmt: skip

    def _roundtrip_before(self, call: Call):
        if call.direction == "d2h":
            return self.roundtrip.before_backup(call.state, call.host, call.device)
        return self.roundtrip.before_load(call.state, call.host, call.device, call.layer)

    def _roundtrip_after(self, call: Call) -> None:
        if call.direction == "d2h":
            self.roundtrip.after_backup(call.state, call.roundtrip)
        else:
            call.checks = self.roundtrip.after_load(call.state, call.roundtrip)

    def invalidate_rows(self, state: PoolState, host_rows: list[int]) -> None:
        """A host page was written from elsewhere (storage tier): forget its digests."""
        if self.roundtrip is not None:
            self.roundtrip.invalidate(state, host_rows)
        if self.restore is not None:
            self.restore.forget_rows(state, host_rows)

    def rows_written_elsewhere(self, token_indices: Any) -> None:
        """Host slots that a writer the probe does not see will fill (a PD host receive:
        prefill writes decode's host pool through the transfer engine, not through a wrapped
        copy): every index-K pool's kept digests of the rows they fall in go, so those rows'
        next load counts `digest_lost` instead of being compared with what they held before
        (a finding nobody made). A pool whose rows these indices do not name loses a few
        digests for nothing, never a finding; indices on a device (their values cannot be
        read here without a sync) take all of each pool's digests, fenced."""
        if self.restore is None:
            return
        import torch

        with self._lock:
            states = [s for s in self._pools.values() if is_index_k_pool(s.geom.name)]
        for state in states:
            if getattr(token_indices, "is_cuda", False):
                self.restore.forget_all_rows(state)
            else:
                pages = torch.unique(torch.as_tensor(token_indices).reshape(-1) // max(1, state.geom.page_size))
                self.invalidate_rows(state, pages.tolist())

    def storage_wrote(self, state: PoolState, host_rows: list[int]) -> None:
        """The storage tier (L3) filled these host pages: their bytes carry no digest here, so
        they are counted unverified (`digest_lost`) on path l3, and their loads likewise."""
        self.invalidate_rows(state, host_rows)
        restore = self.restore
        if restore is not None and is_index_k_pool(state.geom.name):  # a pool not verified says why
            reason = "digest_lost" if restore.pool(state) is not None else restore.why_not(state)
            self._count_on_copy_path("l3", "unverified", reason, len(host_rows) * state.geom.layers * state.geom.item_bytes)

    # -- restore verification ----------------------------------------------------------

    def count_unprobed(self, pool_name: str, path: str, nbytes: int) -> None:
        """A move of a pool that could not be registered (its failure counted and logged):
        an index-K pool's bytes count unverified, `probe_error`, on the move's path (a copy's
        `hicache_backup` or `hicache_load`, a storage-tier page's `l3`)."""
        if self.restore is None or not is_index_k_pool(pool_name):
            return
        self._count_on_copy_path(path, "unverified", "probe_error", nbytes)
        self._start_flusher()  # no registered pool may have started it

    def _count_on_copy_path(self, path: str, outcome: str, reason: str, nbytes: int) -> None:
        """Coverage, counted in a dict (no metric lock on a copy thread), published by the flusher."""
        key = (path, outcome, reason)
        with self._coverage_lock:
            self._coverage[key] = self._coverage.get(key, 0) + int(nbytes)

    def _restore_token_copy(self, call: Call) -> None:
        """A token-granular copy on an index-K pool: its rows are not whole pages, so its
        bytes are counted unverified (`other`); a backup's also makes the host rows' kept
        digests stale (`forget_all_rows`). Page-path copies go to the verifier (`end`)."""
        state = call.state
        if is_index_k_pool(state.geom.name):
            if call.direction == "d2h":
                self.restore.forget_all_rows(state)
            path = "hicache_backup" if call.direction == "d2h" else "hicache_load"
            layers = state.geom.layers if call.layer is None else 1
            self._count_on_copy_path(path, "unverified", "other", call.numel * layers * state.geom.item_bytes
                                     // max(1, state.geom.page_size))

    def _on_restore_evict(self, n: int) -> None:
        self.metrics.records_dropped.labels(sink="hicache_restore").inc(n)

    def _on_restore(self, state: PoolState, comparison: LoadComparison, context: dict) -> None:
        """A load's comparison, on the collector thread: the verdict counted like a room's at
        stage hicache_load; a mismatch counted by cells, logged, recorded with the journal."""
        m = self.metrics
        verdict = comparison.verdict
        m.rooms_verified.labels(stage=RESTORE_STAGE, verdict=verdict).inc()
        if verdict != "mismatch":
            return
        name = state.geom.name
        cells = [dict(layer=self.layer_id(state, c.pool_layer), pool_layer=c.pool_layer, host_row=c.host_row,
                      device_page=c.device_page, segment=c.segment) for c in comparison.cells]
        per_segment: dict[str, int] = {}
        for c in cells:
            per_segment[c["segment"]] = per_segment.get(c["segment"], 0) + 1
        for segment, n in per_segment.items():
            m.mismatch_cells.labels(stage=RESTORE_STAGE, segment=segment).inc(n)
        layers = sorted({c["layer"] for c in cells})
        m.observe_localisation(RESTORE_STAGE, layers, [])
        pages = sorted({c["device_page"] for c in cells})
        diagnosis = []
        for page in pages:
            events = self.journal.events_for(page) if self.journal is not None else []
            # page ids are shared by the DeepSeek-V4 sub-pools: this pool's copies and the PD events
            diagnosis.append({"device_page": page, "host_rows": sorted({c["host_row"] for c in cells
                                                                        if c["device_page"] == page}),
                              "events": [e for e in events if e.get("pool") in (None, name)]})
        self.log.error(
            "dsv4-idxk-probe hicache restore mismatch: pool %s: %d of %d loaded host rows differ from their backup "
            "(%d cells; host rows %s, device pages %s, layers %s, segments %s)",
            name, len(comparison.mismatch_rows), comparison.rows, len(cells), comparison.mismatch_rows[:16],
            pages[:16], layers, sorted(per_segment),
        )  # fmt: skip
        self.emit({"event": "restore_mismatch", "stage": RESTORE_STAGE, "pool": name,
                   "layout": context.get("layout"), "verdict": verdict, "rows": comparison.rows,
                   "mismatch_rows": comparison.mismatch_rows, "unverified_rows": comparison.unverified_rows,
                   "layers": layers, "segments": sorted(per_segment), "cells": cells[:MAX_RESTORE_CELLS],
                   "cells_total": len(cells), "diagnosis": diagnosis[:MAX_RESTORE_CELLS]})  # fmt: skip


def _global_layer_ids(state: PoolState, source: Callable[[], dict[int, int]]) -> tuple[int, ...] | None:
    """The pool's layers as global layer ids, when its device buffers are the model's index-K
    buffers (same data pointers); None otherwise, or while the source knows none yet."""
    try:
        by_ptr = source()
        if not by_ptr or not state.geom.layers:
            return None
        ptrs = [int(state.views.device_layer(layer).data_ptr()) for layer in range(state.geom.layers)]
    except Exception:
        return None
    if not all(p in by_ptr for p in ptrs):
        return None
    return tuple(int(by_ptr[p]) for p in ptrs)


def index_k_layers(runtime: Any) -> dict[int, int]:
    """data pointer -> global layer id of the index-K buffers of the runtime's PD sides."""
    out: dict[int, int] = {}
    for side in list(getattr(runtime, "sides", {}).values()):
        engine = getattr(side, "engine", None)
        buffers, layer_ids = getattr(engine, "buffers", None), getattr(side, "layer_ids", None)
        if getattr(side, "active", False) and buffers and layer_ids and len(buffers) == len(layer_ids):
            for buf, layer in zip(buffers, layer_ids):
                out[int(buf.data_ptr())] = int(layer)
    return out


# -- one probe per runtime ------------------------------------------------------

_probes: dict[int, tuple[Any, HiCacheProbe]] = {}
_probes_lock = threading.Lock()


def probe_for(runtime: Any) -> HiCacheProbe:
    """The probe shared by every wrapper built for `runtime` (created on first use).

    Raises `HiCacheConfigError` naming the field when ``runtime.config.hicache``
    is invalid; wrapper factories run at install time, never inside SGLang calls.
    """
    with _probes_lock:
        entry = _probes.get(id(runtime))
        if entry is not None and entry[0] is runtime:
            return entry[1]
        settings = settings_from_config(getattr(runtime, "config", None))
        probe = HiCacheProbe(runtime.metrics, settings, getattr(runtime, "emit", None), getattr(runtime, "log", None),
                             journal=getattr(runtime, "journal", None),
                             layer_source=lambda: index_k_layers(runtime))
        _probes[id(runtime)] = (runtime, probe)
        return probe


def probe_if_made(runtime: Any) -> HiCacheProbe | None:
    """The probe of `runtime` if its HiCache wrappers made one; None otherwise (makes none)."""
    entry = _probes.get(id(runtime))
    return entry[1] if entry is not None and entry[0] is runtime else None


def forget(runtime: Any) -> None:
    """Drop and close the probe of `runtime` (uninstall, tests)."""
    with _probes_lock:
        entry = _probes.pop(id(runtime), None)
    if entry is not None:
        entry[1].close()
