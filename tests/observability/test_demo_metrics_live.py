"""The demo rig's own metrics, scraped by a real Prometheus, fill the dashboard.

The built-in rig (what `dsv4-idxk-probe demo` runs) serves both children's
metrics on one port through prometheus_client's multiprocess directory, as a
probed SGLang does. Prometheus scrapes it every second while a few rooms run
with injected faults; once decode is done (the rig waits in our event
callback, exporter still up), every dashboard variable must return its label
and every panel of the verification and health rows must return a series.
Not checked here: the HiCache row (the rig has no host pools; the host-pool
exporter of test_prometheus_live fills it), "Digest GPU time" (observed only
on CUDA; the run is on CPU) and "Patch targets" (the rig patches nothing).
"""

from __future__ import annotations

import shutil
import time

import pytest

from dsv4_idxk_probe.testbed.builtin.config import RigConfig, explicit_plan

from tests.support.prometheus_server import LOOPBACK, Prometheus, free_port, wait_for
from tests.support.promql import dashboard_gaps
from tests.support.rigutil import run

WANTED = {("dsv4_idxk_probe_rooms_digested_total", "prefill"), ("dsv4_idxk_probe_rooms_verified_total", "decode"),
          ("dsv4_idxk_probe_mismatch_cells_total", "decode"), ("dsv4_idxk_probe_first_divergence_total", "decode")}
# Coverage: decode counts a room's bytes when it forgets the room, and the rig's few short rooms
# all end within one scrape interval, so a 5-minute increase() may see no step; the panels are
# driven and checked by test_prometheus_live.py.
NOT_FROM_THE_RIG = ("HiCache", "Guard and index-check", "Digest GPU time", "Patch targets", "Coverage")
FAULTS = [
    {"room": 1, "kind": "bitflip", "when": "in_flight", "where": {"layer": 1, "page": 0, "segment": "payload", "offset": 20}},
    {"room": 2, "kind": "zero_page", "when": "after_recv", "where": {"layer": 0, "page": 1}},
]


def test_the_rigs_metrics_fill_every_variable_and_verification_panel(tmp_path):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.fail("prometheus is not installed: run .ci/install-test-services.sh (make test does)")
    port = free_port()
    target = f"{LOOPBACK}:{port}"
    prom = Prometheus(prometheus, tmp_path, [target])
    failures: list[str] = []
    checked = []

    def on_event(event: tuple) -> None:
        if event[:2] != ("done", "decode"):
            return
        # Both children's series scraped at least twice within the panels' 30 s rate window
        # (a scrape can time out under load: then the last good samples must still be recent).
        def scraped_twice_each() -> bool:
            raw = prom.series(f'{{__name__=~"dsv4_idxk_probe_.*_total",instance="{target}"}}[30s]')
            fresh = {(s["metric"]["__name__"], s["metric"]["engine_type"]) for s in raw if len(s["values"]) >= 2}
            return WANTED <= fresh

        wait_for("both children's series scraped twice", scraped_twice_each, timeout=60)
        # A scrape that times out on a loaded machine marks the target's series stale until the
        # next one: ask again a few times before calling a panel empty.
        for _ in range(5):
            failures[:] = missing()
            if not failures:
                break
            time.sleep(2)

    def missing() -> list[str]:
        gaps, asked = dashboard_gaps(prom, NOT_FROM_THE_RIG)
        checked[:] = asked
        return gaps

    try:
        wait_for("prometheus to be ready", prom.ready)
        cfg = RigConfig(layers=2, layout="fp8", plan=explicit_plan([(1, 400, 0, 6), (2, 400, 0, 6), (3, 300, 0, 6)]),
                        pool_source="builtin")
        result = run(tmp_path, cfg, faults=FAULTS, step_interval=2, metrics_port=port, on_event=on_event)
    finally:
        prom.stop()
    assert result.metrics_url and checked, "the rig never finished decode"
    assert len(checked) >= 15
    assert not failures, "\n".join(failures)
