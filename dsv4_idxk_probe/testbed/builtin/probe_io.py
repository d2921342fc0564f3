"""The probe's sinks in a rig child: room log, metrics and the digest exchange.

The same pieces a probed SGLang process uses (RoomLogWriter, ProbeMetrics,
VectorServer/VectorClient), wired from the child's probe config. One seam, so
the rig follows them when they change.
"""

from __future__ import annotations

import logging
from typing import Callable

from prometheus_client import CollectorRegistry

from ...config import ProbeConfig
from ...digest.result import RoomDigest
from ...exchange import VectorClient, VectorServer, pack_endpoint, unpack_endpoint
from ...metrics.definitions import ProbeMetrics
from ...roomlog import RoomLogWriter
from ...safety import add_error_listener

log = logging.getLogger("dsv4_idxk_probe.testbed.builtin")

LOOPBACK = "127.0.0.1"


class ProbeSinks:
    """Room log + metrics of one child; `close()` drains the log."""

    def __init__(self, config: ProbeConfig, role: str):
        # In the rig, PROMETHEUS_MULTIPROC_DIR (set by the parent) makes every
        # value land in the shared directory whatever registry holds the metric.
        self.metrics = ProbeMetrics(CollectorRegistry(), role=role)
        self.metrics.zero_pd_series()
        add_error_listener(self.metrics.count_error)
        cfg = config.roomlog
        self.writer = RoomLogWriter(
            cfg.dir, role, max_bytes=cfg.max_bytes, max_files=cfg.max_files, gzip_rotated=cfg.gzip,
            queue_size=cfg.queue_size, metrics=self.metrics,
        )

    def emit(self, record: dict) -> bool:
        return self.writer.emit(record)

    def close(self) -> None:
        self.writer.close()


def start_exchange(lookup: Callable[[str], RoomDigest | None], config: ProbeConfig, metrics) -> VectorServer | None:
    """Prefill's vector server on loopback, or None when the config turns the exchange off."""
    ex = config.exchange
    if not ex.enabled:
        return None
    server = VectorServer(
        lookup, bind=LOOPBACK, port=ex.port_base, max_request_bytes=ex.max_request_bytes, metrics=metrics,
        secret_file=ex.secret_file, max_connections=ex.max_connections, idle_s=ex.idle_s,
    )
    server.start()
    return server


def endpoint_slot(server: VectorServer | None) -> int:
    """The metadata-row value that tells decode where to ask (0: nowhere)."""
    return pack_endpoint(*server.endpoint) if server is not None else 0


class VectorFetcher:
    """Decode's `fetch_vectors`: asks the endpoint each room's metadata row named."""

    def __init__(self, config: ProbeConfig, metrics, override: tuple[str, int] | None = None):
        ex = config.exchange
        self.client = VectorClient.from_config(ex, metrics) if ex.enabled else None
        self.retry_s = ex.retry_s
        self.override = override
        self.endpoints: dict[str, tuple[str, int]] = {}

    def remember(self, key: str, slot_value: int) -> None:
        endpoint = unpack_endpoint(slot_value)
        if endpoint is not None:
            self.endpoints[key] = (endpoint[0] or LOOPBACK, endpoint[1])

    def __call__(self, key: str) -> RoomDigest | None:
        if self.client is None:
            return None
        return self.client.fetch(self.override or self.endpoints.get(key), key, retry_s=self.retry_s)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def parse_address(text: str | None) -> tuple[str, int] | None:
    """'host:port' -> (host, port); None passes through."""
    if not text:
        return None
    host, _, port = text.rpartition(":")
    return host or LOOPBACK, int(port)
