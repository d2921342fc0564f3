"""A record sink for tests: collects what the probe emits; a test waits for what it expects."""

from __future__ import annotations

import threading


class Sink:
    """Collects emitted records; `wait_for(n, **match)` waits for n records whose fields match."""

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
