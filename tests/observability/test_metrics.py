"""Metric definitions follow the conventions; serving works standalone and in multiprocess mode."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from dsv4_idxk_probe.metrics import serving
from dsv4_idxk_probe.metrics.definitions import BASE_LABELS, PATCH_STATUSES, ProbeMetrics, page_bucket

REPO = Path(__file__).resolve().parents[2]
ALLOWED_LABELS = set(BASE_LABELS) | {
    "stage", "verdict", "segment", "pool", "direction", "branch", "io_backend", "layout", "sink", "kind", "site",
    "target", "status", "check", "action", "leg", "invariant", "page_aligned_only", "token_path_eligible", "layer",
    "page_bucket",
}
BASE = {"role": "decode", "model": "m", "rank": "0"}


def families():
    registry = CollectorRegistry()
    ProbeMetrics(registry, **BASE)
    return [m for m in registry.collect()]


def test_names_types_and_labels_follow_the_conventions():
    seen = families()
    assert len(seen) >= 20
    for family in seen:
        assert re.fullmatch(r"dsv4_idxk_probe_[a-z0-9_]+", family.name), family.name
        assert family.type in ("counter", "histogram", "gauge"), f"{family.name}: {family.type} (no summaries)"
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), f"{family.name}: histograms here time things, in seconds"


def test_label_sets_are_low_cardinality():
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, **BASE)
    for name, bound in vars(metrics).items():
        labels = set(bound._metric._labelnames)
        assert set(BASE_LABELS) <= labels, name
        assert labels <= ALLOWED_LABELS, f"{name}: {labels - ALLOWED_LABELS}"
        assert not labels & {"room", "page", "bootstrap_room", "request_id"}, name


@pytest.mark.parametrize("page, bucket", [(0, "0"), (1, "1"), (2, "2"), (3, "2"), (4, "4"), (1023, "512"), (1024, "1024")])
def test_page_bucket_is_the_power_of_two_at_or_below(page, bucket):
    assert page_bucket(page) == bucket


def test_page_buckets_stay_few_for_long_rooms():
    assert len({page_bucket(p) for p in range(8192)}) == 14


def test_localisation_feeds_layer_and_page_heat():
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, **BASE)
    metrics.observe_localisation("decode_step", layers=[3, 40], pages=[0, 5, 6, 7, 100])
    value = lambda name, **labels: registry.get_sample_value(f"dsv4_idxk_probe_{name}_total", {**BASE, **labels})
    assert value("mismatch_layer_hits", stage="decode_step", layer="40") == 1
    assert value("mismatch_page_bucket_hits", stage="decode_step", page_bucket="4") == 3
    assert value("mismatch_page_bucket_hits", stage="decode_step", page_bucket="64") == 1
    assert value("mismatch_page_bucket_hits", stage="decode_step", page_bucket="0") == 1


def test_patch_target_status_is_one_hot():
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, **BASE)
    metrics.set_patch_target("decode.recv", "missing", required=True)
    metrics.set_patch_target("decode.recv", "patched", required=True)
    got = {s: registry.get_sample_value("dsv4_idxk_probe_patch_target_status", {**BASE, "target": "decode.recv", "status": s})
           for s in PATCH_STATUSES}
    assert got == {s: (1 if s == "patched" else 0) for s in PATCH_STATUSES}
    with pytest.raises(ValueError):
        metrics.set_patch_target("decode.recv", "fine", required=False)


def test_patch_statuses_are_the_ones_the_patcher_reports():
    from dsv4_idxk_probe.sglang.targets import STATUSES

    assert set(PATCH_STATUSES) == set(STATUSES)


def test_standalone_exporter_serves_and_stops():
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, **BASE)
    metrics.zero_pd_series()
    metrics.rooms_verified.labels(stage="decode_recv", verdict="mismatch").inc(2)
    server, thread = serving.start_exporter(0, "127.0.0.1", registry)
    try:
        port = server.server_address[1]
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    thread.join(timeout=5)
    assert not thread.is_alive() and thread.daemon
    assert re.search(r'dsv4_idxk_probe_rooms_verified_total\{[^}]*stage="decode_recv",verdict="mismatch"\} 2\.0', body)
    assert 'verdict="unverified"} 0.0' in body  # zero is visible


def test_inside_sglang_nothing_is_started(monkeypatch, tmp_path):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert serving.expose(9, "127.0.0.1", CollectorRegistry()) is None


CHILD = """
from dsv4_idxk_probe.metrics.definitions import ProbeMetrics
m = ProbeMetrics(role="decode", model="m", rank="{rank}")
m.zero_pd_series()
m.rooms_verified.labels(stage="decode_finish", verdict="mismatch").inc(3)
m.set_patch_target("hicache.backup", "missing", required=True)
m.digest_gpu_seconds.labels(stage="decode_recv").observe(0.002)
"""


def test_multiprocess_directory_reaches_the_hosts_collector(tmp_path):
    """Two scheduler processes write; the host's MultiProcessCollector (as SGLang's /metrics) reads both."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for rank in (0, 1):
        subprocess.run([sys.executable, "-c", CHILD.format(rank=rank)], env=env, check=True, timeout=120)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    for rank in ("0", "1"):
        labels = {"role": "decode", "model": "m", "rank": rank}
        assert registry.get_sample_value(
            "dsv4_idxk_probe_rooms_verified_total", {**labels, "stage": "decode_finish", "verdict": "mismatch"}) == 3
        assert registry.get_sample_value(
            "dsv4_idxk_probe_patch_target_status", {**labels, "target": "hicache.backup", "status": "missing"}) == 1
        assert registry.get_sample_value(
            "dsv4_idxk_probe_digest_gpu_seconds_count", {**labels, "stage": "decode_recv"}) == 1


def test_every_metric_is_documented():
    doc = (REPO / "docs" / "observability.md").read_text()
    missing = [f.name for f in families() if f.name + ("_total" if f.type == "counter" else "") not in doc]
    assert not missing, f"docs/observability.md does not mention {missing}"


def test_labelled_children_are_cached_and_still_count_into_the_registry():
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, **BASE)
    first = metrics.rooms_verified.labels(stage="decode_recv", verdict="match")
    assert metrics.rooms_verified.labels(stage="decode_recv", verdict="match") is first
    for _ in range(3):
        metrics.rooms_verified.labels(stage="decode_recv", verdict="match").inc()
    metrics.rooms_verified.labels(verdict="match", stage="decode_recv").inc()  # other keyword order, same series
    value = registry.get_sample_value(
        "dsv4_idxk_probe_rooms_verified_total", {**BASE, "stage": "decode_recv", "verdict": "match"})
    assert value == 4


def test_the_child_cache_stays_bounded(monkeypatch):
    from dsv4_idxk_probe.metrics import definitions

    monkeypatch.setattr(definitions._Bound, "_MAX_CHILDREN", 4)
    metrics = ProbeMetrics(CollectorRegistry(), **BASE)
    for i in range(10):
        metrics.probe_errors.labels(site=f"s{i}").inc()
    assert len(metrics.probe_errors._children) <= 4
