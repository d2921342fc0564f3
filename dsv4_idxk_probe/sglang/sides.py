"""The prefill or decode side of one scheduler, from SGLang's pool.

Built once per process, when SGLang creates its PD queue (the
``_init_kv_manager`` hooks) or, failing that, on the first hook call. This
module holds only what needs SGLang knowledge: finding the DeepSeek-V4 pool,
its index-K geometry (layer ids, buffers, the layout its rows follow), the
wire positions in the transfer's ``kv_args``, and the address SGLang's KV
manager reports to its peers. The side itself (digest engine, monitor,
exchange) is assembled by dsv4_idxk_probe.pd.assembly, as the built-in rig's
is. A pool the probe cannot read (not DeepSeek-V4, unknown row layout) gives
an inactive side: logged once with the reason, and every hook of that role
then calls straight through.

A side whose build fails (its engine, monitor or exchange raises) is tried
once: what the build made before it failed (the engine and its collector
thread, started by the CUDA warm-up; an exchange server or client) is closed,
the failure is counted (``errors_total``, site ``<role>.build``) and logged once,
and a failed `InactiveSide` takes the role's place, so every later hook call is
a cheap no-op instead of another build that leaks another engine and thread.
"""

from __future__ import annotations

import logging
import threading
from functools import partial
from typing import Any

from ..digest.layout import load_layouts, shipped_layouts
from ..exchange.endpoint import rule_port
from ..pd.assembly import DecodeAssembly, PrefillAssembly, exchange_bind, exchange_port
from ..pd.records import set_cluster
from ..safety import record_error
from .index_k import IndexKError, IndexKGeometry, choose_layout, dsv4_pool, index_k_geometry, wire_positions
from .index_k import index_pools as list_index_pools
from .pool_sides import (
    DecodeFanOut, PoolRoutedRooms, PrefillFanOut, build_pool_sides, fetch_pool_digest, unread_bytes_per_page,
)

log = logging.getLogger("dsv4_idxk_probe")

_build_lock = threading.Lock()


class InactiveSide:
    """Stands in for a side that could not be built; hooks see `active` False."""

    active = False

    def __init__(self, role: str, reason: str, *, failed: bool = False, code: str = "layout_unknown",
                 bytes_per_page: int = 0, page_tokens: int = 256):
        self.role = role
        self.reason = reason
        self.failed = failed  # the build raised (not a pool the probe does not apply to)
        self.code = "build_failed" if failed else code  # the status metric's reason (STATES["inactive"])
        self.bytes_per_page = bytes_per_page  # index-K bytes per full page of the pool it cannot read
        self.page_tokens = page_tokens


def _close_partial(side: Any) -> None:
    """Close what a side's constructor made before it raised: the exchange, then the engine
    (whose collector thread the warm-up started). Never raises."""
    for name in ("server", "client", "engine"):
        part = side.__dict__.get(name)
        if part is None:
            continue
        try:
            part.close()
        except Exception:
            log.debug("dsv4-idxk-probe: closing the failed side's %s failed", name, exc_info=True)


class PrefillSide(PrefillAssembly):
    """The prefill assembly over SGLang's pool; the exchange binds where SGLang's KV manager
    is reached (``bind: auto``), on ``port_base`` + the scheduler's GPU id."""

    def __init__(self, runtime: Any, geometry: IndexKGeometry, layout: Any, *, host: str | None, gpu_id: int | None,
                 pools: tuple = (), rank_port: int | None = None):
        config = runtime.config
        self.pool_sides = []  # further index pools (V4.1): pool_sides.py
        try:
            # sends pass the room's token indices (`prefill_room_pages`): the engine reads each page's first
            super().__init__(layout, geometry.layer_ids, geometry.buffers, config, runtime.emit, runtime.metrics,
                             bind=exchange_bind(config.exchange, host), port=exchange_port(config.exchange, gpu_id, rank_port),
                             page_id_stride=int(geometry.page_size))
            self.pool_sides = build_pool_sides("prefill", pools, config, runtime.emit, runtime.metrics)
        except BaseException:
            _close_partial(self)
            raise
        # every prefill side answers pool keys: a PP stage without a pool answers its rooms empty
        self.monitor.recent = PoolRoutedRooms(self.monitor.recent, {p.ratio: p.monitor.recent for p in self.pool_sides},
                                              held=[p.ratio for p in pools])
        if self.pool_sides:
            self.monitor = PrefillFanOut(self.monitor, self.pool_sides, self.page_id_stride)
        self.pools = tuple(pools)
        self.runtime = runtime
        self.geometry = geometry
        self.inband_deferred = 0  # digests not ready when the aux data left (no blocking copy on that path)

    def close(self) -> None:
        super().close()
        for pool in self.pool_sides:
            pool.close()


class DecodeSide(DecodeAssembly):
    """The decode assembly over SGLang's pool, with the hooks' per-process state."""

    def __init__(self, runtime: Any, geometry: IndexKGeometry, layout: Any, pools: tuple = ()):
        self.pool_sides = []  # further index pools (V4.1): pool_sides.py
        try:
            super().__init__(layout, geometry.layer_ids, geometry.buffers, runtime.config, runtime.emit,
                             runtime.metrics, journal=getattr(runtime, "journal", None))
            fetch = partial(fetch_pool_digest, self) if self.client is not None else None
            self.pool_sides = build_pool_sides("decode", pools, runtime.config, runtime.emit, runtime.metrics, fetch)
        except BaseException:
            _close_partial(self)
            raise
        unread = unread_bytes_per_page(pools)
        if self.pool_sides or unread:
            self.monitor = DecodeFanOut(self.monitor, self.pool_sides, runtime.metrics, unread, int(geometry.page_size))
        self.pools = tuple(pools)
        self.runtime = runtime
        self.geometry = geometry
        self.batches = 0  # decode batches seen: `decode_step` runs every step_interval of them
        self.enforce_agreed = True  # enforce: every attention-TP rank runs an active probe (sglang.enforce)

    def close(self) -> None:
        super().close()
        for pool in self.pool_sides:
            pool.close()


def _layouts(config: Any) -> dict:
    layouts = dict(shipped_layouts())
    if config.layouts:
        layouts.update(load_layouts(config.layouts))
    return layouts


def build_side(runtime: Any, role: str, pool: Any, kv_args: Any = None, *, host: str | None = None,
               gpu_id: int | None = None, rank_port: int | None = None, dcp_size: int = 1) -> Any:
    """Build and attach `role`'s side once; later calls return the same object, a failed
    build's `InactiveSide` too (one attempt per process: see the module's docstring).
    `dcp_size`: the KV manager's decode context parallel size (its ranks share each page's
    tokens, a layout the probe does not read: inactive, `layout_unknown`)."""
    with _build_lock:
        existing = runtime.sides.get(role)
        if existing is not None:  # a queue init again: SGLang's PD role switch came back
            _publish_state(runtime, existing)
            if role == "prefill":
                _follow_rank_port(runtime, existing, rank_port)
            return existing
        set_cluster(getattr(runtime.config.roomlog, "cluster", ""))  # before the side's first record
        try:
            side = _make(runtime, role, pool, kv_args, host, gpu_id, rank_port, dcp_size)
        except Exception as exc:
            record_error(f"{role}.build")  # counted; logged with its traceback the first time
            reason = f"the {role} side failed to build: {type(exc).__name__}: {exc}"
            log.error("dsv4-idxk-probe: %s; its hooks call straight through from now on (not retried)", reason)
            side = InactiveSide(role, reason, failed=True)
        runtime.attach(role, side)
        _publish_state(runtime, side)
        patcher = getattr(runtime, "patcher", None)
        if patcher is not None:
            patcher.verify()
        return side


def _follow_rank_port(runtime: Any, side: Any, rank_port: int | None) -> None:
    """A kept prefill side's exchange follows the ``port_offset`` rule to the new KV manager's
    port: decode rebuilds the exchange's port from the port the bootstrap server reports,
    which is the new manager's (exchange/endpoint.py, `rule_port`)."""
    port = rule_port(rank_port, getattr(runtime.config.exchange, "port_offset", 0))
    move = getattr(side, "move_exchange", None)  # an InactiveSide serves nothing
    if port and move is not None:
        move(port)


def _publish_state(runtime: Any, side: Any) -> None:
    """The status metric says the state of the side of the role the server runs now:
    `inactive` with the reason for a side that verifies nothing (it must not read as
    on/running), `on` for one that verifies. A server that switched roles (SGLang's PD role
    switch builds the new role's queues, and the probe its side) reads the new role's."""
    try:
        metrics = runtime.metrics
        if metrics is not None:
            if side.active:
                metrics.info.set("on", "running", runtime.mode)
            else:
                metrics.info.set("inactive", side.code, runtime.mode)
    except Exception:
        log.debug("dsv4-idxk-probe: the side's state could not be published", exc_info=True)


def _make(runtime, role, pool, kv_args, host, gpu_id, rank_port=None, dcp_size=1):
    pools: list = []
    try:
        pool = dsv4_pool(pool)
        if pool is None:
            raise IndexKError("the KV pool is not a DeepSeek-V4 pool", code="not_dsv4")
        layouts = _layouts(runtime.config)
        pools = list_index_pools(pool, layouts, kv_args, runtime.config.layout)
        if dcp_size > 1:  # SGLang lays a page's tokens out over the DCP ranks (or relays them so)
            raise IndexKError(f"decode context parallel over {dcp_size} ranks shares each page's tokens among "
                              "them; the probe digests whole pages", code="layout_unknown")
        geometry = index_k_geometry(pool)
        if kv_args is not None:
            try:
                geometry = _with_wire(geometry, kv_args)
            except IndexKError as exc:  # digest anyway: a missing index-K transfer is a finding
                log.warning("dsv4-idxk-probe (%s): %s", role, exc)
        layout = choose_layout(geometry, runtime.config.layout, layouts)
    except Exception as exc:
        reason = str(exc) if isinstance(exc, IndexKError) else f"{type(exc).__name__}: {exc}"
        log.warning("dsv4-idxk-probe: %s side inactive: %s", role, reason)
        code = exc.code if isinstance(exc, IndexKError) else "layout_unknown"
        return InactiveSide(role, reason, code=code, bytes_per_page=sum(p.bytes_per_page for p in pools),
                            page_tokens=int(getattr(pool, "page_size", 256) or 256))
    log.info(
        "dsv4-idxk-probe %s side: %d C4 layers %s, layout %s (%d B rows), mode %s",
        role, len(geometry.layer_ids), list(geometry.layer_ids), layout.name, layout.row_bytes, runtime.mode,
    )
    for extra in pools[1:]:  # V4.1's low-ratio pools: read, or why not (their bytes are counted unverified)
        (log.info if extra.readable else log.warning)("dsv4-idxk-probe %s side: %s", role, extra.describe())
    if role == "prefill":
        return PrefillSide(runtime, geometry, layout, host=host, gpu_id=gpu_id, pools=tuple(pools), rank_port=rank_port)
    return DecodeSide(runtime, geometry, layout, pools=tuple(pools))


def _with_wire(geometry: IndexKGeometry, kv_args: Any) -> IndexKGeometry:
    from dataclasses import replace

    return replace(geometry, wire=wire_positions(geometry.buffers, kv_args))
