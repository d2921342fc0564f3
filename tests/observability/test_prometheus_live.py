"""A real Prometheus scrapes live probe exporters; every dashboard and alert query must return data.

Two exporters (prefill, decode) start with their zero series, Prometheus
scrapes them every second, then the exporters see what a bad night looks
like: matching and mismatching rooms (real digests, real `compare`), a
room with no prefill digest, a layout change, drops from a full room-log
queue, a token-path copy on the indexer pool, a missing required patch
target. A third process runs the real activation with a broken config (its
probe stays off and says so), and a fourth stands for an SGLang server with
no probe at all. Then every PromQL expression of the dashboard and the alert
rules goes to Prometheus's HTTP API and must parse and return at least one
series, and the alerts must fire. Loopback only; every wait has a deadline.
"""

from __future__ import annotations

import json
import shutil
import sys
import types
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from logdata import Fault, RoomPlan, room_records
from prometheus_client import CollectorRegistry, Gauge
from promql import ALERTS, alert_rules, load_dashboard, panel_queries, substitute, variable_queries

from dsv4_idxk_probe.digest.result import RoomDigest, compare
from dsv4_idxk_probe.metrics.definitions import ProbeMetrics
from dsv4_idxk_probe.vocabulary import HICACHE_BRANCHES
from dsv4_idxk_probe.metrics.serving import start_exporter
from dsv4_idxk_probe.roomlog import RoomLogWriter

LOOPBACK = "127.0.0.1"
DEADLINE_S = 30.0
POOLS = ("deepseek_v4_c4_indexer", "deepseek_v4_c4")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def wait_for(what: str, check, timeout: float = DEADLINE_S, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


class Prometheus:
    def __init__(self, binary, tmp_path, targets):
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        rules = tmp_path / "alerts.yml"
        shutil.copy(ALERTS, rules)
        config = tmp_path / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "dsv4-idxk-probe", "static_configs": [{"targets": targets}]}],
        }))
        self.log = open(tmp_path / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address={LOOPBACK}:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )

    def get(self, path: str, **params):
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:  # 400 carries Prometheus's parse error
            return json.loads(exc.read())

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited with {self.proc.returncode}; see {self.log.name}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def query(self, expr: str) -> dict:
        return self.get("/api/v1/query", query=expr)

    def series(self, expr: str) -> list:
        answer = self.query(expr)
        return answer["data"]["result"] if answer.get("status") == "success" else []

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


def sglang_labels(engine_type: str, tp_rank: int = 0) -> dict:
    return {"model_name": "dsv4-test", "engine_type": engine_type, "tp_rank": str(tp_rank), "pp_rank": "0", "moe_ep_rank": "0"}


def start_probe(role: str):
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, labels=sglang_labels(role))
    metrics.zero_pd_series()
    for pool in POOLS:
        metrics.hicache_pool_info.labels(pool=pool, layout="layer_first", page_aligned_only="false",
                                         token_path_eligible=str(pool.endswith("indexer")).lower()).set(1)
        metrics.hicache_guard.labels(pool=pool, action="counted")
        for direction in ("d2h", "h2d"):
            for branch in HICACHE_BRANCHES:
                metrics.hicache_copies.labels(pool=pool, direction=direction, io_backend="kernel", layout="layer_first", branch=branch)
    metrics.set_patch_target("pd.decode_recv", "patched", required=True)
    metrics.set_patch_target("hicache.backup_tokens", "missing" if role == "decode" else "patched", required=True)
    server, thread = start_exporter(0, LOOPBACK, registry)
    return metrics, server, thread


def drive_prefill(metrics: ProbeMetrics, n_rooms: int) -> None:
    metrics.rooms_digested.labels(stage="prefill_send").inc(n_rooms)
    metrics.digest_bytes.labels(stage="prefill_send").inc(n_rooms * 4 * 3 * 8448)
    for _ in range(n_rooms):
        metrics.digest_gpu_seconds.labels(stage="prefill_send").observe(0.0004)


def drive_decode(metrics: ProbeMetrics, plans: list[RoomPlan], tmp_path) -> None:
    """What the decode monitor records, from real digests and the real comparison."""
    for plan in plans:
        prefill, decode = room_records(plan)
        expected = RoomDigest.from_record(prefill[0]["digest"]) if prefill else None
        diverged = False
        for rec in decode:
            stage = rec["stage"]
            observed = RoomDigest.from_record(rec["digest"])
            metrics.rooms_digested.labels(stage=stage).inc()
            metrics.digest_bytes.labels(stage=stage).inc(4 * 3 * 8448)
            metrics.digest_gpu_seconds.labels(stage=stage).observe(0.0003)
            metrics.verify_latency_seconds.labels(stage=stage).observe(0.002)
            if expected is None:
                metrics.rooms_verified.labels(stage=stage, verdict="unverified").inc()
                continue
            c = compare(expected, observed)
            metrics.rooms_verified.labels(stage=stage, verdict=c.verdict).inc()
            if c.verdict == "mismatch":
                for segment in c.segments:
                    metrics.mismatch_cells.labels(stage=stage, segment=segment).inc(len(c.pages))
                metrics.observe_localisation(stage, c.layers, c.pages)
                if not diverged:
                    metrics.first_divergence.labels(stage=stage).inc()
                    diverged = True
    metrics.exchange_errors.labels(kind="fetch").inc()
    metrics.count_error("decode.emit")
    writer = RoomLogWriter(tmp_path / "roomlog", "decode", queue_size=1, metrics=metrics, start=False)
    assert [writer.emit({"v": 1, "kind": "room", "room": str(i)}) for i in range(3)] == [True, False, False]
    writer.close()
    # HiCache: the page path, and one token-granular copy on the indexer pool (the bug the guard exists for).
    hc = metrics.hicache_copies
    hc.labels(pool="deepseek_v4_c4", direction="d2h", io_backend="kernel", layout="layer_first", branch="page").inc(40)
    hc.labels(pool="deepseek_v4_c4_indexer", direction="d2h", io_backend="kernel", layout="layer_first", branch="page").inc(40)
    hc.labels(pool="deepseek_v4_c4_indexer", direction="h2d", io_backend="kernel", layout="layer_first", branch="token_dsv4_mla").inc()
    metrics.hicache_guard.labels(pool="deepseek_v4_c4_indexer", action="counted").inc()
    metrics.hicache_index_violations.labels(pool="deepseek_v4_c4_indexer", direction="h2d", check="page_aligned").inc()
    metrics.hicache_invariant_violations.labels(pool="deepseek_v4_c4_indexer", invariant="row_bytes").inc()
    metrics.hicache_roundtrip.labels(pool="deepseek_v4_c4_indexer", leg="load", verdict="match").inc(3)
    metrics.hicache_pages.labels(pool="deepseek_v4_c4_indexer", direction="d2h").inc(80)


def start_broken_probe(tmp_path, monkeypatch):
    """The real activation with an invalid config: the probe stays off, and publishes
    dsv4_idxk_probe_info{state="broken"} under the labels SGLang publishes (a stand-in
    for sglang.srt.runtime_context, which is all the probe reads them from)."""
    from dsv4_idxk_probe import activation

    ns = types.SimpleNamespace
    context = ns(get_serving=lambda: ns(served_model_name="dsv4-test"),
                 get_disagg=lambda: ns(disaggregation_mode="decode", enable_pd_role_switch=False),
                 get_parallel=lambda: ns(tp_rank=1, pp_rank=0, moe_ep_rank=0, dp_rank=None),
                 get_observability=lambda: ns(extra_metric_labels=None))
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", context)
    bad = tmp_path / "probe.yaml"
    bad.write_text("exchange:\n  timeout_ms: fast\n")
    registry = CollectorRegistry()
    assert activation.install({"DSV4_IDXK_PROBE": "1", "DSV4_IDXK_PROBE_CONFIG": str(bad)}, registry=registry) is False
    labels = {**sglang_labels("decode", 1), "state": "broken", "reason": "config_error"}
    wait_for("the broken state", lambda: any(s.labels.items() >= labels.items() and s.value == 1
                                             for f in registry.collect() for s in f.samples), timeout=10)
    return start_exporter(0, LOOPBACK, registry)


def start_sglang_without_probe():
    """An SGLang decode server's own metrics, and none of the probe's."""
    registry = CollectorRegistry()
    labels = sglang_labels("decode")
    Gauge("sglang:context_len", "Maximum context length.", list(labels), registry=registry).labels(**labels).set(65536)
    return start_exporter(0, LOOPBACK, registry)


@pytest.fixture
def prometheus_binary():
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail("prometheus is not installed: run .ci/install-test-services.sh (make test does)")
    return path


def test_dashboard_and_alert_queries_return_data_from_a_real_prometheus(prometheus_binary, tmp_path, monkeypatch):
    probes = {role: start_probe(role) for role in ("prefill", "decode")}
    probes["broken"] = (None, *start_broken_probe(tmp_path, monkeypatch))
    probes["sglang"] = (None, *start_sglang_without_probe())
    targets = [f"{LOOPBACK}:{server.server_address[1]}" for _, server, _ in probes.values()]
    prom = Prometheus(prometheus_binary, tmp_path, targets)
    try:
        wait_for("prometheus to be ready", prom.ready)
        # Zero series scraped first, so increase() sees every event that follows.
        scraped_twice = '(count_over_time(up{job="dsv4-idxk-probe"}[1m]) >= 2) and (up == 1)'
        wait_for("all four exporters up and scraped twice", lambda: len(prom.series(scraped_twice)) == 4)
        plans = [RoomPlan(1), RoomPlan(2), RoomPlan(3, fault=Fault(2, 1, 7, "decode_step")), RoomPlan(4, fault=Fault(0, 2, 8200)),
                 RoomPlan(5, prefill=False), RoomPlan(6, signature_drift=True)]
        drive_prefill(probes["prefill"][0], len(plans))
        drive_decode(probes["decode"][0], plans, tmp_path)
        wait_for("the mismatches scraped twice",
                 lambda: prom.series('count_over_time((dsv4_idxk_probe_rooms_verified_total{verdict="mismatch"} > 0)[1m:1s]) >= 2'))
        # Series born with an event (no zero series) need two raw samples before rate() sees them.
        def scraped_twice_each() -> bool:
            raw = prom.series('{__name__=~"dsv4_idxk_probe_(hicache|mismatch)_.*"}[1m]')  # raw samples per series
            return bool(raw) and all(len(series["values"]) >= 2 for series in raw)

        wait_for("every new series scraped twice", scraped_twice_each)

        def missing() -> list[str]:
            out = []
            for where, expr in panel_queries(load_dashboard()):
                answer = prom.query(substitute(expr))
                if answer.get("status") != "success":
                    out.append(f"{where}: does not parse: {answer.get('error')}")
                elif not answer["data"]["result"]:
                    out.append(f"{where}: no series for {substitute(expr)}")
            for name, selector, label in variable_queries(load_dashboard()):
                found = prom.series(substitute(selector))
                if not found or not all(label in s["metric"] for s in found):
                    out.append(f"variable {name}: no {label} values from {selector}")
            for rule in alert_rules():
                if not prom.series(rule["expr"]):
                    out.append(f"alert {rule['alert']}: no series for {rule['expr']}")
            return out

        # A scrape that times out on a loaded machine marks its target's series stale until the
        # next one: ask again a few times before calling a query empty.
        for _ in range(5):
            failures = missing()
            if not failures:
                break
            time.sleep(2)
        assert not failures, "\n".join(failures)

        mismatches = prom.series(substitute(next(e for w, e in panel_queries(load_dashboard()) if w.startswith("Mismatching rooms /"))))
        assert float(mismatches[0]["value"][1]) >= 1
        heat = prom.series('sum by (layer) (dsv4_idxk_probe_mismatch_layer_hits_total)')
        assert {s["metric"]["layer"] for s in heat} == {"0", "2"}

        rules = prom.get("/api/v1/rules")["data"]["groups"][0]["rules"]
        assert sorted(r["name"] for r in rules) == sorted(r["alert"] for r in alert_rules())
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]

        def alert_states():
            alerts = prom.get("/api/v1/alerts")["data"]["alerts"]
            return {(a["labels"]["alertname"], a["state"]) for a in alerts}

        expected = {("Dsv4IdxkProbeIndexKMismatch", "firing"), ("Dsv4IdxkProbeTokenPathOnNonC4Pool", "firing"),
                    ("Dsv4IdxkProbeRecordsDropped", "firing"), ("Dsv4IdxkProbeRequiredPatchTargetMissing", "pending"),
                    ("Dsv4IdxkProbeOffByError", "firing"), ("Dsv4IdxkProbeMetricsAbsent", "pending")}
        wait_for(f"alerts {sorted(expected)}", lambda: expected <= alert_states(), timeout=15)
        alerts = prom.get("/api/v1/alerts")["data"]["alerts"]
        mismatch = [a for a in alerts if a["labels"]["alertname"] == "Dsv4IdxkProbeIndexKMismatch"]
        # Two corrupt rooms (first seen at decode_recv and at decode_step): one alert each, though
        # the decode_step room also mismatched at decode_finish.
        assert sorted(a["labels"]["stage"] for a in mismatch) == ["decode_recv", "decode_step"], mismatch
        (broken,) = [a for a in alerts if a["labels"]["alertname"] == "Dsv4IdxkProbeOffByError"]
        assert broken["labels"]["reason"] == "config_error" and broken["labels"]["tp_rank"] == "1"
        (absent,) = [a for a in alerts if a["labels"]["alertname"] == "Dsv4IdxkProbeMetricsAbsent"]
        assert absent["labels"]["instance"] == targets[3]
    finally:
        prom.stop()
        for _, server, thread in probes.values():
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
