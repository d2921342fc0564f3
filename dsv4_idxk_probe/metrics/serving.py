"""Expose the probe's metrics: SGLang's /metrics when inside SGLang, else our own port.

Inside SGLang, ``PROMETHEUS_MULTIPROC_DIR`` is set before prometheus_client is
imported, so every metric registered in the default registry writes to that
directory and SGLang's multiprocess collector serves it on its own /metrics:
there is nothing to start. Standalone (the demo rig, tests, tools) the probe
starts prometheus_client's HTTP server on the configured port and address,
loopback unless `metrics.addr` says otherwise (a wildcard or routable
address is logged once at WARNING: /metrics has no authentication).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

log = logging.getLogger("dsv4_idxk_probe.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LOOPBACK = "127.0.0.1"


def inside_multiprocess_host() -> bool:
    """True when a host (SGLang) aggregates metrics through its multiprocess directory."""
    return bool(os.environ.get(MULTIPROC_ENV))


def _is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:
        return False


def start_exporter(
    port: int, addr: str = LOOPBACK, registry: CollectorRegistry = REGISTRY
) -> tuple[WSGIServer, threading.Thread]:
    """Serve `registry` on addr:port from a daemon thread (port 0 picks a free one).

    Returns (server, thread): stop with ``server.shutdown(); server.server_close()``.
    """
    if not _is_loopback(addr):
        log.warning("dsv4-idxk-probe metrics exporter listens on %s (not loopback; /metrics is unauthenticated)",
                    addr or "all addresses")
    server, thread = start_http_server(port, addr=addr, registry=registry)
    log.info("dsv4-idxk-probe metrics on http://%s:%d/metrics", addr, server.server_address[1])
    return server, thread


def expose(port: int | None, addr: str = LOOPBACK, registry: CollectorRegistry = REGISTRY):
    """Start our exporter unless a multiprocess host serves the metrics; None when nothing was started."""
    if inside_multiprocess_host() or port is None:
        return None
    return start_exporter(port, addr, registry)
