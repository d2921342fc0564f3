"""The probe's sinks in a rig child: room log and metrics, and the exchange's addresses.

A probed SGLang process gets its room log and metrics from the runtime; a rig
child makes the same pieces (RoomLogWriter, ProbeMetrics) from its probe
config here. The side itself (engine, monitor, exchange server or client) is
built by dsv4_idxk_probe.pd.assembly, as SGLang's is; the rig's exchange
listens on loopback.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from ...config import ProbeConfig
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


def parse_address(text: str | None) -> tuple[str, int] | None:
    """'host:port' -> (host, port); None passes through."""
    if not text:
        return None
    host, _, port = text.rpartition(":")
    return host or LOOPBACK, int(port)
