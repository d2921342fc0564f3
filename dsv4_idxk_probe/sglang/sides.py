"""The prefill or decode side of one scheduler: digest engine, monitor, exchange.

Built once per process, when SGLang creates its PD queue (the
``_init_kv_manager`` hooks) or, failing that, on the first hook call, from the
pool, the transfer's ``kv_args`` and the address SGLang's KV manager reports
to its peers. A pool the probe cannot read (not DeepSeek-V4, unknown row
layout) gives an inactive side: logged once with the reason, and every hook
of that role then calls straight through.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from ..digest.engine import DigestEngine
from ..digest.layout import load_layouts, shipped_layouts
from ..pd import DecodeMonitor, PrefillMonitor
from .index_k import IndexKError, IndexKGeometry, choose_layout, dsv4_pool, index_k_geometry, wire_positions

log = logging.getLogger("dsv4_idxk_probe")

_build_lock = threading.Lock()


class InactiveSide:
    """Stands in for a side that could not be built; hooks see `active` False."""

    active = False

    def __init__(self, role: str, reason: str):
        self.role = role
        self.reason = reason


class _Side:
    active = True

    def __init__(self, runtime: Any, geometry: IndexKGeometry, layout: Any):
        self.runtime = runtime
        self.geometry = geometry
        self.layout = layout
        self.engine = DigestEngine.from_config(layout, geometry.layer_ids, geometry.buffers, runtime.config, role=self.role)
        self.signature = self.engine.signature


class PrefillSide(_Side):
    role = "prefill"

    def __init__(self, runtime: Any, geometry: IndexKGeometry, layout: Any, *, host: str | None, gpu_id: int | None):
        super().__init__(runtime, geometry, layout)
        config = runtime.config
        self.monitor = PrefillMonitor(self.engine, runtime.emit, runtime.metrics, table_size=config.exchange.table_size)
        self.server = None  # exchange.VectorServer when the exchange is on
        self.endpoint_slot = 0
        self.inband_deferred = 0  # digests not ready when the aux data left (no blocking copy on that path)
        bind = _bind_address(config.exchange, host)
        if config.exchange.enabled and bind:
            from ..exchange import VectorServer, pack_endpoint

            port = config.exchange.port_base + int(gpu_id or 0) if config.exchange.port_base else 0
            server = VectorServer(
                self.monitor.lookup, bind=bind, port=port,
                max_request_bytes=config.exchange.max_request_bytes, metrics=runtime.metrics,
                secret_file=config.exchange.secret_file, max_connections=config.exchange.max_connections, idle_s=config.exchange.idle_s,
            )
            try:
                server.start()
                self.server = server
                self.endpoint_slot = pack_endpoint(bind, server.port)
            except Exception as exc:
                log.error("dsv4-idxk-probe: exchange cannot bind %s:%s (%s); decode can match rooms but not localise",
                          bind, port, exc)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.engine.close()


class DecodeSide(_Side):
    role = "decode"

    def __init__(self, runtime: Any, geometry: IndexKGeometry, layout: Any):
        super().__init__(runtime, geometry, layout)
        config = runtime.config
        self.client = None
        if config.exchange.enabled:
            from ..exchange import VectorClient

            self.client = VectorClient.from_config(config.exchange, runtime.metrics)
        self._peers: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._peers_cap = config.exchange.table_size
        self._retry_s = config.exchange.retry_s
        self.batches = 0  # decode batches seen: `decode_step` runs every step_interval of them
        self.enforce_agreed = True  # enforce: every attention-TP rank runs an active probe (pd_decode)
        self._lock = threading.Lock()
        self.monitor = DecodeMonitor(
            self.engine, runtime.emit, runtime.metrics,
            fetch_vectors=self.fetch_to_localise if self.client is not None else None,
            fetch_always=config.exchange.fetch_always,
            step_interval=config.step_interval,
            max_rooms=config.exchange.table_size,
            diagnosis=_diagnosis(runtime, layout, geometry.layer_ids),
            snapshot_on_allocation=getattr(getattr(config, "diagnosis", None), "snapshot_on_allocation", False),
        )

    def remember_peer(self, key: str, endpoint: tuple[str, int] | None) -> None:
        if endpoint is None:
            return
        with self._lock:
            self._peers[key] = endpoint
            self._peers.move_to_end(key)
            while len(self._peers) > self._peers_cap:
                self._peers.popitem(last=False)

    def fetch(self, key: str, retry_s: float = 0.0):
        with self._lock:
            endpoint = self._peers.get(key)
        return self.client.fetch(endpoint, key, retry_s=retry_s)

    def fetch_to_localise(self, key: str):
        """The monitor's fetch, on the collector thread: it may wait out a short backoff."""
        return self.fetch(key, self._retry_s)

    def close(self) -> None:
        self.engine.close()
        if self.client is not None:
            self.client.close()


def _diagnosis(runtime: Any, layout: Any, layer_ids) -> Any:
    """Decode's diagnosis (content index + the process's page journal), or None when off."""
    from ..diagnosis.tracker import decode_diagnosis

    return decode_diagnosis(runtime.config, layout, layer_ids, getattr(runtime, "journal", None))


def _bind_address(exchange: Any, host: str | None) -> str | None:
    if exchange.bind == "auto":
        return host or None
    return exchange.bind or None


def _layouts(config: Any) -> dict:
    layouts = dict(shipped_layouts())
    if config.layouts:
        layouts.update(load_layouts(config.layouts))
    return layouts


def build_side(runtime: Any, role: str, pool: Any, kv_args: Any = None, *, host: str | None = None,
               gpu_id: int | None = None) -> Any:
    """Build and attach `role`'s side once; later calls return the same object."""
    with _build_lock:
        existing = runtime.sides.get(role)
        if existing is not None:
            return existing
        side = _make(runtime, role, pool, kv_args, host, gpu_id)
        runtime.attach(role, side)
        patcher = getattr(runtime, "patcher", None)
        if patcher is not None:
            patcher.verify()
        return side


def _make(runtime, role, pool, kv_args, host, gpu_id):
    try:
        pool = dsv4_pool(pool)
        if pool is None:
            raise IndexKError("the KV pool is not a DeepSeek-V4 pool")
        geometry = index_k_geometry(pool)
        if kv_args is not None:
            try:
                geometry = _with_wire(geometry, kv_args)
            except IndexKError as exc:  # digest anyway: a missing index-K transfer is a finding
                log.warning("dsv4-idxk-probe (%s): %s", role, exc)
        layout = choose_layout(geometry, runtime.config.layout, _layouts(runtime.config))
    except Exception as exc:
        reason = str(exc) if isinstance(exc, IndexKError) else f"{type(exc).__name__}: {exc}"
        log.warning("dsv4-idxk-probe: %s side inactive: %s", role, reason)
        return InactiveSide(role, reason)
    log.info(
        "dsv4-idxk-probe %s side: %d C4 layers %s, layout %s (%d B rows), mode %s",
        role, len(geometry.layer_ids), list(geometry.layer_ids), layout.name, layout.row_bytes, runtime.mode,
    )
    if role == "prefill":
        return PrefillSide(runtime, geometry, layout, host=host, gpu_id=gpu_id)
    return DecodeSide(runtime, geometry, layout)


def _with_wire(geometry: IndexKGeometry, kv_args: Any) -> IndexKGeometry:
    from dataclasses import replace

    return replace(geometry, wire=wire_positions(geometry.buffers, kv_args))
