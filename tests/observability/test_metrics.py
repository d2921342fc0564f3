"""Metric definitions follow the conventions; serving works standalone and in multiprocess mode."""

from __future__ import annotations

import json
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
from dsv4_idxk_probe.metrics.definitions import PROCESS_LABELS, ProbeMetrics, page_bucket, process_labels
from dsv4_idxk_probe.vocabulary import DECODE_STAGES, PATCH_STATUSES, STAGES

REPO = Path(__file__).resolve().parents[2]
# SGLang's labels of one decode scheduler (what sglang.accessors.identity() returns).
SGLANG_LABELS = {"model_name": "dsv4", "engine_type": "decode", "tp_rank": "1", "pp_rank": "0", "moe_ep_rank": "1"}
ALLOWED_LABELS = set(PROCESS_LABELS) | {
    "stage", "verdict", "segment", "pool", "direction", "branch", "io_backend", "layout", "sink", "kind", "component",
    "state", "reason", "mode", "version",
    "target", "status", "check", "action", "leg", "invariant", "page_aligned_only", "token_path_eligible", "layer",
    "page_bucket",
    "path", "outcome",  # coverage_bytes (docs/coverage.md): a few fixed words each
    "gpu_uuid", "hostname", "cuda_device",  # gpu_info: one series per process, set once
}
BASE = dict(SGLANG_LABELS)


def families():
    registry = CollectorRegistry()
    ProbeMetrics(registry, labels=BASE)
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
    metrics = ProbeMetrics(registry, labels=BASE)
    for family in registry.collect():
        metric = registry._names_to_collectors[family.name + ("_total" if family.type == "counter" else "")]
        labels, name = set(metric._labelnames), family.name
        assert set(PROCESS_LABELS) <= labels, name
        assert labels <= ALLOWED_LABELS, f"{name}: {labels - ALLOWED_LABELS}"
        assert not labels & {"room", "page", "bootstrap_room", "request_id"}, name


@pytest.mark.parametrize("page, bucket", [(0, "0"), (1, "1"), (2, "2"), (3, "2"), (4, "4"), (1023, "512"), (1024, "1024")])
def test_page_bucket_is_the_power_of_two_at_or_below(page, bucket):
    assert page_bucket(page) == bucket


def test_page_buckets_stay_few_for_long_rooms():
    assert len({page_bucket(p) for p in range(8192)}) == 14


def test_localisation_feeds_layer_and_page_heat():
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, labels=BASE)
    metrics.observe_localisation("decode_step", layers=[3, 40], pages=[0, 5, 6, 7, 100])
    value = lambda name, **labels: registry.get_sample_value(f"dsv4_idxk_probe_{name}_total", {**BASE, **labels})
    assert value("mismatch_layer_hits", stage="decode_step", layer="40") == 1
    assert value("mismatch_page_bucket_hits", stage="decode_step", page_bucket="4") == 3
    assert value("mismatch_page_bucket_hits", stage="decode_step", page_bucket="64") == 1
    assert value("mismatch_page_bucket_hits", stage="decode_step", page_bucket="0") == 1


def test_patch_target_status_is_one_hot():
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, labels=BASE)
    metrics.set_patch_target("decode.recv", "missing", required=True)
    metrics.set_patch_target("decode.recv", "patched", required=True)
    got = {s: registry.get_sample_value("dsv4_idxk_probe_patch_target_status", {**BASE, "target": "decode.recv", "status": s})
           for s in PATCH_STATUSES}
    assert got == {s: (1 if s == "patched" else 0) for s in PATCH_STATUSES}
    with pytest.raises(ValueError):
        metrics.set_patch_target("decode.recv", "fine", required=False)



def test_standalone_exporter_serves_and_stops():
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, labels=BASE)
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
    assert re.search(r'dsv4_idxk_probe_rooms_verified_total\{[^}]*stage="decode_recv"[^}]*verdict="mismatch"\} 2\.0', body)
    assert 'verdict="unverified"} 0.0' in body  # zero is visible


def test_inside_sglang_nothing_is_started(monkeypatch, tmp_path):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert serving.expose(9, "127.0.0.1", CollectorRegistry()) is None


CHILD = """
import sys
from dsv4_idxk_probe.metrics.definitions import ProbeMetrics
m = ProbeMetrics(labels={{"model_name": "m", "engine_type": "decode", "tp_rank": "{rank}", "pp_rank": "0", "moe_ep_rank": "0"}})
m.zero_pd_series()
m.rooms_verified.labels(stage="decode_finish", verdict="mismatch").inc(3)
m.set_patch_target("hicache.backup", "missing", required=True)
m.digest_gpu_seconds.labels(stage="decode_recv").observe(0.002)
print("ready", flush=True)
sys.stdin.readline()
"""


def test_multiprocess_directory_reaches_the_hosts_collector(tmp_path):
    """Two scheduler processes, running side by side as SGLang's ranks do, write; the host's
    MultiProcessCollector (as SGLang's /metrics) reads both. (One started after the other had
    exited would forget that one's gauges: test_a_restarted_process_...)"""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    children = [subprocess.Popen([sys.executable, "-c", CHILD.format(rank=rank)], env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE) for rank in (0, 1)]
    try:
        assert [c.stdout.readline().strip() for c in children] == ["ready", "ready"]
    finally:
        for c in children:
            c.communicate("\n", timeout=120)
    assert [c.returncode for c in children] == [0, 0]
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    for rank in ("0", "1"):
        labels = {"model_name": "m", "engine_type": "decode", "tp_rank": rank, "pp_rank": "0", "moe_ep_rank": "0"}
        assert registry.get_sample_value(
            "dsv4_idxk_probe_rooms_verified_total", {**labels, "stage": "decode_finish", "verdict": "mismatch"}) == 3
        assert registry.get_sample_value(
            "dsv4_idxk_probe_patch_target_status", {**labels, "target": "hicache.backup", "status": "missing"}) == 1
        assert registry.get_sample_value(
            "dsv4_idxk_probe_digest_gpu_seconds_count", {**labels, "stage": "decode_recv"}) == 1


RESTART_LABELS = {"model_name": "m", "engine_type": "decode", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
CRASHED_BROKEN = f"""
import os, signal
from prometheus_client import REGISTRY
from dsv4_idxk_probe.metrics.definitions import ProbeInfo, process_labels
ProbeInfo(REGISTRY, process_labels({RESTART_LABELS!r})).set("broken", "config_error")
os.kill(os.getpid(), signal.SIGKILL)  # as a scheduler killed by its parent
"""
RESTARTED_ON = f"""
import json
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from dsv4_idxk_probe.metrics.definitions import ProbeMetrics
ProbeMetrics(labels={RESTART_LABELS!r}).set_patch_target("pd.send_kv_chunk", "patched", required=True)
registry = CollectorRegistry()
MultiProcessCollector(registry)
print(json.dumps(sorted([s.labels["state"], s.value] for f in registry.collect() if f.name == "dsv4_idxk_probe_info"
                        for s in f.samples)))
"""


def test_a_restarted_process_does_not_show_the_dead_ones_state(tmp_path):
    """Issue "Reliability round two": a scheduler that failed (broken) was killed and restarted
    with the same labels; SGLang's /metrics showed broken and on at once, for good."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    crashed = subprocess.run([sys.executable, "-c", CRASHED_BROKEN], env=env, timeout=120)
    assert crashed.returncode == -9
    out = subprocess.run([sys.executable, "-c", RESTARTED_ON], env=env, timeout=120, check=True,
                         capture_output=True, text=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [["on", 1.0]], out.stdout


def test_gauge_files_of_gone_processes_and_of_a_reused_pid_are_forgotten(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True, timeout=60)
    dead_pid, me = int(dead.stdout), os.getpid()
    names = {
        f"gauge_livemax_{dead_pid}.db": False,  # its process is gone
        f"gauge_liveall_{dead_pid}.db": False,
        f"gauge_max_{dead_pid}.db": True,  # not a live gauge: prometheus_client keeps it by design
        f"counter_{dead_pid}.db": True,
        f"gauge_livemax_{me}.db": True,  # this process, written since it started
    }
    for name in names:
        (tmp_path / name).write_bytes(b"")
    reused = tmp_path / "gauge_livesum_1.db"  # pid 1 runs, and started after this file was last written
    reused.write_bytes(b"")
    os.utime(reused, (0, 0))
    forgotten = serving.forget_dead_processes(tmp_path)
    assert dead_pid in forgotten and me not in forgotten and 1 in forgotten
    assert {name: (tmp_path / name).exists() for name in names} == names
    assert not reused.exists()


def test_every_metric_is_documented():
    doc = (REPO / "docs" / "observability.md").read_text()
    missing = [f.name for f in families() if f.name + ("_total" if f.type == "counter" else "") not in doc]
    assert not missing, f"docs/observability.md does not mention {missing}"


def test_labelled_children_are_cached_and_still_count_into_the_registry():
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, labels=BASE)
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
    metrics = ProbeMetrics(CollectorRegistry(), labels=BASE)
    for i in range(10):
        metrics.mismatch_layer_hits.labels(stage="decode_recv", layer=str(i)).inc()
    assert len(metrics.mismatch_layer_hits._children) <= 4


def series(registry) -> list[dict]:
    return [dict(sample.labels, __name__=sample.name) for family in registry.collect() for sample in family.samples
            if not sample.name.endswith("_created")]


def test_no_label_value_is_empty_in_or_out_of_sglang():
    for labels, role in ((BASE, None), ({}, "prefill"), ({"model_name": "", "engine_type": "decode"}, None), ({}, None)):
        registry = CollectorRegistry()
        metrics = ProbeMetrics(registry, labels=labels, role=role)
        metrics.zero_pd_series()
        found = series(registry)
        assert found
        empty = [s for s in found if "" in s.values()]
        assert not empty, empty[:3]


def test_dp_rank_and_extra_labels_follow_sglang_and_never_shadow_the_probes_own():
    labels = process_labels({**SGLANG_LABELS, "dp_rank": "3", "cluster": "eu1", "stage": "x", "bad-name": "y"})
    assert labels == {**SGLANG_LABELS, "dp_rank": "3", "cluster": "eu1"}
    assert "dp_rank" not in process_labels(SGLANG_LABELS)
    assert list(process_labels(SGLANG_LABELS)) == list(PROCESS_LABELS)  # SGLang's order


@pytest.mark.parametrize("engine_type, digested, judged", [
    ("prefill", {"prefill_send"}, set()),
    ("decode", set(DECODE_STAGES), set(DECODE_STAGES)),
    ("dynamic", set(STAGES), set(DECODE_STAGES)),
    ("unified", set(), set()),
])
def test_zero_series_only_for_label_sets_that_can_occur(engine_type, digested, judged):
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, labels={**SGLANG_LABELS, "engine_type": engine_type})
    metrics.zero_pd_series()
    found = series(registry)
    stages = lambda name: {s["stage"] for s in found if s["__name__"] == f"dsv4_idxk_probe_{name}"}
    assert stages("rooms_digested_total") == digested
    assert stages("digest_bytes_total") == digested
    assert stages("rooms_verified_total") == judged
    assert stages("first_divergence_total") == judged
    components = {s["component"] for s in found if s["__name__"] == "dsv4_idxk_probe_errors_total"}
    assert ("prefill" in components) == ("prefill_send" in digested)
    assert ("decode" in components) == bool(judged)
    assert {"digest", "hicache", "patch", "other"} <= components
    fetch = [s for s in found if s["__name__"] == "dsv4_idxk_probe_exchange_errors_total"]
    assert bool(fetch) == bool(judged)  # only decode asks prefill for vectors


def test_errors_are_counted_by_component_and_the_name_does_not_stutter():
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, labels=BASE)
    for site in ("decode.on_result", "decode.emit", "factory.pd.send_kv_chunk", "weird"):
        metrics.count_error(site)
    value = lambda c: registry.get_sample_value("dsv4_idxk_probe_errors_total", {**BASE, "component": c})
    assert (value("decode"), value("patch"), value("other")) == (2, 1, 1)
    assert not [f.name for f in registry.collect() if "probe_probe" in f.name]


def test_info_is_one_hot_on_the_current_state():
    from dsv4_idxk_probe.version import __version__

    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, labels=BASE, mode="enforce")
    info = lambda state, reason: registry.get_sample_value("dsv4_idxk_probe_info", {
        **BASE, "state": state, "reason": reason, "mode": "enforce", "version": __version__})
    assert info("on", "running") == 1
    metrics.info.set("off", "uninstalled", "enforce")
    assert (info("on", "running"), info("off", "uninstalled")) == (0, 1)
    with pytest.raises(ValueError):
        metrics.info.set("on", "because")
