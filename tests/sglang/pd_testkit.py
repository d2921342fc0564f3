"""Helpers shared by the SGLang adapter tests: a record sink and a test Runtime."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry
from tests.support.recordsink import Sink  # noqa: F401  (re-exported to the adapter tests)

from dsv4_idxk_probe.config import parse_config
from dsv4_idxk_probe.runtime import Runtime


def make_runtime(**config) -> tuple[Runtime, Sink, CollectorRegistry]:
    document = {"exchange": {"bind": "127.0.0.1", "timeout_ms": 500}, "step_interval": 2}
    document.update(config)
    registry = CollectorRegistry()
    sink = Sink()
    runtime = Runtime(parse_config(document, "<test>"), registry=registry, emit=sink)
    return runtime, sink, registry


def collected(engine, timeout_s: float) -> None:
    """Wait until `engine`'s collector has handled everything posted to it so far."""
    done = threading.Event()
    engine.post(lambda _: done.set())
    assert done.wait(timeout_s), f"the collector did not get through its queue within {timeout_s} s"
