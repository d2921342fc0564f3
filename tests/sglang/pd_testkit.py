"""Helpers shared by the SGLang adapter tests: a record sink and a test Runtime."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry

from dsv4_idxk_probe.config import parse_config
from dsv4_idxk_probe.runtime import Runtime


class Sink:
    """Collects emitted records; lets a test wait for a number of them."""

    def __init__(self):
        self.records: list[dict] = []
        self.cond = threading.Condition()

    def __call__(self, record: dict) -> None:
        with self.cond:
            self.records.append(record)
            self.cond.notify_all()

    def wait_for(self, n: int, timeout: float = 10.0, **match) -> list[dict]:
        def selected():
            return [r for r in self.records if all(r.get(k) == v for k, v in match.items())]

        with self.cond:
            assert self.cond.wait_for(lambda: len(selected()) >= n, timeout), (
                f"got {len(selected())} of {n} records matching {match}: {self.records}"
            )
            return selected()



def make_runtime(**config) -> tuple[Runtime, Sink, CollectorRegistry]:
    document = {"exchange": {"bind": "127.0.0.1", "timeout_ms": 500}, "step_interval": 2}
    document.update(config)
    registry = CollectorRegistry()
    sink = Sink()
    runtime = Runtime(parse_config(document, "<test>"), registry=registry, emit=sink)
    return runtime, sink, registry
