"""The standalone metrics exporter listens on loopback unless told otherwise; inside SGLang, nowhere."""

from __future__ import annotations

import logging
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from dsv4_idxk_probe import activation
from dsv4_idxk_probe.config import ProbeConfig, MetricsConfig
from dsv4_idxk_probe.metrics.serving import start_exporter


def test_exporter_binds_loopback_by_default():
    registry = CollectorRegistry()
    Counter("probe_test_total", "x", registry=registry).inc()
    server, _ = start_exporter(0, registry=registry)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "probe_test_total 1.0" in body
    finally:
        server.shutdown()
        server.server_close()


def test_a_wildcard_exporter_is_logged_at_warning(caplog):
    caplog.set_level(logging.WARNING, "dsv4_idxk_probe.metrics")
    server, _ = start_exporter(0, addr="0.0.0.0", registry=CollectorRegistry())
    try:
        assert any("not loopback" in r.getMessage() for r in caplog.records)
    finally:
        server.shutdown()
        server.server_close()


def test_inside_sglang_metrics_port_opens_no_listener(caplog, monkeypatch):
    started = []
    monkeypatch.setattr("dsv4_idxk_probe.metrics.serving.start_exporter", lambda *a, **k: started.append(a))

    class Runtime:
        config = ProbeConfig(metrics=MetricsConfig(port=9400))

    caplog.set_level(logging.WARNING, "dsv4_idxk_probe")
    activation._start_exporter(Runtime())
    assert started == []
    assert any("metrics.port 9400 is not served inside SGLang" in r.getMessage() for r in caplog.records)
