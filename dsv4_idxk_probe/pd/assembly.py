"""One side of a PD transfer, assembled: digest engine, monitor, exchange.

A side is built from what the serving process knows (the row layout, the C4
layer ids, the index-K buffers) and what the probe holds (its config, where
records go, its metrics). The SGLang adapter (dsv4_idxk_probe.sglang.sides)
finds those in SGLang's pool and the built-in rig (testbed.builtin) has its
own; both build the side here, so the rig runs the very assembly a probed
SGLang process runs. No SGLang import.

* `PrefillAssembly`: engine, `PrefillMonitor`, and the exchange server that
  hands decode a recent room's vectors (`endpoint_slot` tells decode, through
  the metadata row, where it listens);
* `DecodeAssembly`: engine, `DecodeMonitor` (with diagnosis when configured),
  and the exchange client with the bounded table of each room's prefill
  endpoint.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Callable, Sequence

from ..digest.engine import DigestEngine
from ..digest.result import RoomDigest
from ..exchange.endpoint import pack_endpoint, unpack_endpoint
from .decode import DecodeMonitor
from .prefill import PrefillMonitor

log = logging.getLogger("dsv4_idxk_probe")

Emit = Callable[[dict], Any]
Endpoint = tuple[str, int]


def exchange_bind(exchange: Any, host: str | None) -> str | None:
    """The address prefill's exchange binds: ``bind: auto`` means `host` (the address
    the serving side reports to its peers); an empty address means no server."""
    if exchange.bind == "auto":
        return host or None
    return exchange.bind or None


def exchange_port(exchange: Any, gpu_id: int | None, rank_port: int | None = None) -> int:
    """The port prefill's exchange binds: the transport's `rank_port` + ``port_offset`` when
    that is set (decode can then rebuild it: exchange/endpoint.py, `rule_port`), else
    ``port_base`` + the GPU id, else 0 (one the OS picks)."""
    from ..exchange.endpoint import rule_port

    by_rule = rule_port(rank_port, getattr(exchange, "port_offset", 0))
    if by_rule:
        return by_rule
    return exchange.port_base + int(gpu_id or 0) if exchange.port_base else 0


def peer_endpoint(slot_value: int | None, fallback_host: str | None) -> Endpoint | None:
    """Where to ask for a room's vectors, from its metadata row's endpoint slot.

    The slot holds no host when prefill's address is not IPv4: `fallback_host`
    (the address the transport knows the sending rank by) stands in. None when
    the slot names no endpoint or no host is known.
    """
    endpoint = unpack_endpoint(slot_value) if slot_value is not None else None
    if endpoint is None:
        return None
    host = endpoint[0] or fallback_host
    return (host, endpoint[1]) if host else None


class PrefillAssembly:
    """Prefill's engine, monitor and exchange server (None when off or not started)."""

    active = True
    role = "prefill"

    def __init__(self, layout: Any, layer_ids: Sequence[int], buffers: Sequence[Any], config: Any, emit: Emit,
                 metrics: Any = None, *, bind: str | None, port: int = 0, require_exchange: bool = False,
                 page_id_stride: int = 1):
        """`bind` / `port`: the exchange's address (`exchange_bind`, `exchange_port`);
        no server when `bind` is empty or the config turns the exchange off.
        `require_exchange`: a server that cannot start raises (a test bed) instead
        of being logged, the side then running without it. `page_id_stride`: entries
        per page of the page tables the sends pass (`DigestEngine`)."""
        self.layout = layout
        self.layer_ids = list(layer_ids)
        self.engine = DigestEngine.from_config(layout, self.layer_ids, buffers, config, role=self.role,
                                               page_id_stride=page_id_stride)
        self.page_id_stride = page_id_stride  # what the sends pass (the engine reads it so)
        self.signature = self.engine.signature
        ex = config.exchange
        self.monitor = PrefillMonitor(self.engine, emit, metrics, table_size=ex.table_size)
        self.server = None  # exchange.VectorServer when the exchange is on
        self.endpoint_slot = 0  # the metadata-row value that tells decode where to ask (0: nowhere)
        self._exchange_at = (ex, metrics, bind)  # what `_serve_on` starts a server with
        if ex.enabled and bind:
            self._serve_on(port, require_exchange)

    def _serve_on(self, port: int, required: bool) -> bool:
        """Start an exchange server on `port` and serve from it; False (logged) when it cannot
        bind (`required`: raise instead), the current server, if any, kept."""
        from ..exchange import VectorServer  # msgspec and the server load only where one runs

        ex, metrics, bind = self._exchange_at
        server = VectorServer(
            self.monitor.lookup, bind=bind, port=port, max_request_bytes=ex.max_request_bytes, metrics=metrics,
            secret_file=ex.secret_file, max_connections=ex.max_connections, idle_s=ex.idle_s,
        )
        try:
            server.start()
        except Exception as exc:
            if required:
                raise
            log.error("dsv4-idxk-probe: exchange cannot bind %s:%s (%s); decode can match rooms but not localise",
                      bind, port, exc)
            return False
        self.server = server
        self.endpoint_slot = pack_endpoint(bind, server.port)
        return True

    def move_exchange(self, port: int) -> None:
        """Serve the exchange on `port` from now on: the transport's port moved (SGLang's PD
        role switch makes a new KV manager), and a decode that rebuilds the exchange's port
        from it (``port_offset``) asks there. The old server closes once the new one
        listens; one that cannot bind leaves the old one serving (logged)."""
        old = self.server
        if old is None or not port or port == old.port:
            return
        if self._serve_on(port, False):
            log.info("dsv4-idxk-probe: exchange moved from port %s to %s (the transport's port moved)", old.port, port)
            old.close()

    def close(self) -> None:
        """Deliver the digests still in flight, then stop serving them."""
        self.engine.close()
        if self.server is not None:
            self.server.close()


class DecodeAssembly:
    """Decode's engine, monitor and exchange client (None when the exchange is off).

    The monitor localises a mismatch with the vectors it fetches from the
    endpoint remembered for the room (`remember_peer`), or from
    `peer_override` when given (a test bed pointing every room at one address).
    """

    active = True
    role = "decode"

    def __init__(self, layout: Any, layer_ids: Sequence[int], buffers: Sequence[Any], config: Any, emit: Emit,
                 metrics: Any = None, *, journal: Any = None, peer_override: Endpoint | None = None):
        """`journal`: the process's page journal for diagnosis (one is made when None)."""
        from ..diagnosis.tracker import decode_diagnosis

        self.layout = layout
        self.layer_ids = list(layer_ids)
        self.engine = DigestEngine.from_config(layout, self.layer_ids, buffers, config, role=self.role)
        self.signature = self.engine.signature
        ex = config.exchange
        self.client = None
        if ex.enabled:
            from ..exchange import VectorClient

            self.client = VectorClient.from_config(ex, metrics)
        self.peer_override = peer_override
        self._peers: OrderedDict[str, Endpoint] = OrderedDict()
        self._peers_cap = ex.table_size
        self._retry_s = ex.retry_s
        self._lock = threading.Lock()
        self.monitor = DecodeMonitor(
            self.engine, emit, metrics,
            fetch_vectors=self.fetch_to_localise if self.client is not None else None,
            fetch_always=ex.fetch_always,
            step_interval=config.step_interval,
            max_rooms=ex.table_size,
            diagnosis=decode_diagnosis(config, layout, self.layer_ids, journal),
            snapshot_on_allocation=getattr(getattr(config, "diagnosis", None), "snapshot_on_allocation", False),
        )

    def remember_peer(self, key: str, endpoint: Endpoint | None) -> None:
        """Room `key`'s prefill endpoint (`peer_endpoint`); the table keeps the newest ``table_size``."""
        if endpoint is None:
            return
        with self._lock:
            self._peers[key] = endpoint
            self._peers.move_to_end(key)
            while len(self._peers) > self._peers_cap:
                self._peers.popitem(last=False)

    def fetch(self, key: str, retry_s: float = 0.0) -> RoomDigest | None:
        """Prefill's full digest of room `key`, or None (exchange off, unknown peer, no answer)."""
        if self.client is None:
            return None
        with self._lock:
            endpoint = self.peer_override or self._peers.get(key)
        return self.client.fetch(endpoint, key, retry_s=retry_s)

    def fetch_to_localise(self, key: str) -> RoomDigest | None:
        """The monitor's fetch, on the collector thread: it may wait out a short backoff."""
        return self.fetch(key, self._retry_s)

    def close(self) -> None:
        """Deliver every pending verdict, then drop the client's connections."""
        self.engine.close()
        if self.client is not None:
            self.client.close()
