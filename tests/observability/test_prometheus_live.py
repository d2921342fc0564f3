"""A real Prometheus scrapes live exporters; every dashboard, alert and documented query must
return data.

Exporters on loopback, scraped every second:

- a prefill and a decode probe, each beside the SGLang metrics its server publishes
  (scheduler and tokenizer series under SGLang's own names). They start with their zero
  series, then see what a bad night looks like: matching and mismatching rooms (real
  digests, real `compare`), a room with no prefill digest, a layout change, drops from a
  full room-log queue, a token-path copy on the indexer pool, a missing required patch
  target, a caught error, an exchange error, a failed KV transfer; the prefill server's
  rank 1 publishes a side that failed to build (state inactive);
- a process where the real activation met a broken config (its probe stays off, says so);
- an SGLang decode server with no probe at all;
- an "idle" decode server without HiCache whose probe is on and sees no transfer while
  SGLang finishes requests;
- a DCGM exporter with GPUs on the probes' hosts and on another one.

The prefill, idle and probe-less servers serve the text format (SGLang's names keep their
colon, as with Prometheus 3 or an older prometheus_client), the others OpenMetrics
(prometheus_client >= 0.22 escapes the colon to an underscore): every SGLang query must
find both. The scrape adds `cluster` and `namespace` to the prefill and decode targets only,
and `node` to decode only (as the shipped PodMonitor does), so the template variables are
asked with and without their labels and the GPU row joins DCGM both by node and by host.

Then every PromQL expression of the dashboard (without its `or vector(0)`), the alert rules
and docs/observability.md goes to Prometheus's HTTP API and must parse and return at least
one series; the panels must count rooms as the operator expects, say 0 or why they are
empty for the idle server, and the alerts must fire. Every wait has a deadline.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from dsv4_idxk_probe.digest.result import RoomDigest, compare
from dsv4_idxk_probe.metrics.definitions import ProbeInfo, ProbeMetrics
from dsv4_idxk_probe.metrics.serving import start_exporter
from dsv4_idxk_probe.roomlog import RoomLogWriter
from dsv4_idxk_probe.vocabulary import HICACHE_BRANCHES

from tests.support.logdata import Fault, RoomPlan, room_records
from tests.support.prometheus_server import LOOPBACK, Prometheus, wait_for
from tests.support.promql import (alert_rules, doc_queries, is_external, load_dashboard, panel_queries, strip_fallback,
                                  substitute, variable_queries)

POOLS = ("deepseek_v4_c4_indexer", "deepseek_v4_c4")
MODEL = "dsv4-test"
DECODE_NODE = "gpu-node-7"  # the decode target's `node` label; its DCGM GPUs carry Hostname=gpu-node-7
PLANS = [RoomPlan(1), RoomPlan(2), RoomPlan(3, fault=Fault(2, 1, 7, "decode_step")), RoomPlan(4, fault=Fault(0, 2, 8200)),
         RoomPlan(5, prefill=False), RoomPlan(6, signature_drift=True), *(RoomPlan(n) for n in range(7, 11))]
CORRUPT_ROOMS = 2  # rooms 3 and 4; room 3 mismatches at decode_step and decode_finish, room 4 at every stage
# Index-K bytes decode counts per room for coverage: a 4k-token room of DeepSeek-V4 (16 pages x 30 C4
# layers x 8448 B rows), so the ten rooms move more than Dsv4IdxkProbeCoverageLow's 32 MiB minimum.
ROOM_INDEX_K_BYTES = 16 * 30 * 8448
# docs/observability.md's join as it stood: nothing on Prometheus 2.x with an escaping client,
# a many-to-many error as soon as two pods of one model publish sglang:context_len.
OLD_DOC_JOIN = "dsv4_idxk_probe_rooms_verified_total * on (model_name, tp_rank) group_left sglang:context_len"


def sglang_labels(engine_type: str, tp_rank: int = 0) -> dict:
    return {"model_name": MODEL, "engine_type": engine_type, "tp_rank": str(tp_rank), "pp_rank": "0", "moe_ep_rank": "0"}


class SGLangMetrics:
    """The SGLang series a PD server publishes that the dashboard and alerts read, under SGLang's
    names and labels (SchedulerMetricsCollector's process labels; TokenizerMetricsCollector's
    model_name, engine_type and is_streaming)."""

    def __init__(self, registry: CollectorRegistry, engine_type: str):
        sched = sglang_labels(engine_type)
        tokenizer = {"model_name": MODEL, "engine_type": engine_type}

        def gauge(name, value=0.0):
            Gauge(f"sglang:{name}", name, list(sched), registry=registry).labels(**sched).set(value)

        gauge("context_len", 65536)
        self.requests = Counter("sglang:num_requests_total", "Number of requests processed.", [*tokenizer, "is_streaming"],
                                registry=registry).labels(**tokenizer, is_streaming="false")
        self.transfer_failed = Counter("sglang:num_transfer_failed_reqs_total", "x", list(sched), registry=registry).labels(**sched)
        Counter("sglang:num_bootstrap_failed_reqs_total", "x", list(sched), registry=registry).labels(**sched)
        self.latency = self.bootstrap = None
        if engine_type == "prefill":
            gauge("num_prefill_bootstrap_queue_reqs", 2)
            gauge("num_prefill_inflight_queue_reqs", 1)
            buckets = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
            self.latency = Histogram("sglang:kv_transfer_latency_ms", "x", list(sched), registry=registry,
                                     buckets=buckets).labels(**sched)
            self.bootstrap = Histogram("sglang:kv_transfer_bootstrap_ms", "x", list(sched), registry=registry,
                                       buckets=buckets[:-1]).labels(**sched)
        else:
            gauge("num_decode_prealloc_queue_reqs", 3)
            gauge("num_decode_transfer_queue_reqs", 1)


class TextExporter:
    """/metrics in the text format whatever Prometheus asks for (SGLang's gRPC sidecar, an
    older prometheus_client): SGLang's names keep their colon."""

    def __init__(self, registry: CollectorRegistry):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                data = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()


def serve(registry: CollectorRegistry, text: bool):
    if text:
        exporter = TextExporter(registry)
        return exporter.server, exporter.thread
    return start_exporter(0, LOOPBACK, registry)


def start_probe(role: str, *, hicache: bool = True, text: bool = False):
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, labels=sglang_labels(role))
    metrics.zero_pd_series()
    gpu = PROBE_GPUS.get(role) if hicache else None  # the idle probe: a process without GPU identity
    if gpu:
        metrics.publish_gpu({"gpu_uuid": f"GPU-{gpu[0]}-{gpu[1]}", "hostname": gpu[0], "cuda_device": "0"})
    if hicache:
        for pool in POOLS:
            metrics.hicache_pool_info.labels(pool=pool, layout="layer_first", page_aligned_only="false",
                                             token_path_eligible=str(pool.endswith("indexer")).lower()).set(1)
            metrics.hicache_guard.labels(pool=pool, action="counted")
            for direction in ("d2h", "h2d"):
                for branch in HICACHE_BRANCHES:
                    metrics.hicache_copies.labels(pool=pool, direction=direction, io_backend="kernel", layout="layer_first", branch=branch)
        if role == "prefill":  # restore verification's load verdicts (docs/hicache.md), at zero from the start
            for verdict in ("match", "mismatch"):
                metrics.rooms_verified.labels(stage="hicache_load", verdict=verdict)
    if role == "prefill" and hicache:  # rank 1 of this server: its prefill side failed to build (sglang/sides.py)
        ProbeInfo(registry, sglang_labels("prefill", tp_rank=1)).set("inactive", "build_failed")
    metrics.set_patch_target("pd.decode_recv", "patched", required=True)
    metrics.set_patch_target("hicache.backup_tokens", "missing" if role == "decode" and hicache else "patched", required=True)
    sglang = SGLangMetrics(registry, role)
    server, thread = serve(registry, text)
    return (metrics, sglang), server, thread


def drive_prefill(metrics: ProbeMetrics, sglang: SGLangMetrics, n_rooms: int) -> None:
    metrics.rooms_digested.labels(stage="prefill_send").inc(n_rooms)
    metrics.digest_bytes.labels(stage="prefill_send").inc(n_rooms * 4 * 3 * 8448)
    for _ in range(n_rooms):
        metrics.digest_gpu_seconds.labels(stage="prefill_send").observe(0.0004)
        sglang.latency.observe(12.0)
        sglang.bootstrap.observe(3.0)
    sglang.requests.inc(n_rooms)
    metrics.rooms_verified.labels(stage="hicache_load", verdict="mismatch").inc()  # one corrupt HiCache load


def drive_decode(metrics: ProbeMetrics, sglang: SGLangMetrics, plans: list[RoomPlan], tmp_path) -> None:
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
                if stage == "decode_recv":  # coverage: once per room (pd/coverage.py)
                    metrics.count_coverage("pd", "unverified", "no_exchange", ROOM_INDEX_K_BYTES)
                continue
            c = compare(expected, observed)
            if stage == "decode_recv":
                verified = c.verdict in ("match", "mismatch")
                metrics.count_coverage("pd", "verified" if verified else c.verdict,
                                       "none" if verified else "layout_differs", ROOM_INDEX_K_BYTES)
            metrics.rooms_verified.labels(stage=stage, verdict=c.verdict).inc()
            if c.verdict == "mismatch":
                for segment in c.segments:
                    metrics.mismatch_cells.labels(stage=stage, segment=segment).inc(len(c.pages))
                metrics.observe_localisation(stage, c.layers, c.pages)
                if not diverged:
                    metrics.first_divergence.labels(stage=stage).inc()
                    diverged = True
    metrics.mismatch_unlocalised.labels(stage="decode_recv").inc()  # one whose prefill vectors were not fetched
    sglang.requests.inc(len(plans))
    sglang.transfer_failed.inc()
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
    context = ns(get_serving=lambda: ns(served_model_name=MODEL),
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


DCGM_GPUS = (("127.0.0.1", "0"), (DECODE_NODE, "0"), (DECODE_NODE, "1"), ("other-node", "0"))
PROBE_GPUS = {"prefill": ("127.0.0.1", "0"), "decode": (DECODE_NODE, "1")}  # (host, gpu) of each probe's GPU


def start_dcgm():
    """dcgm-exporter's series for GPUs on the probes' hosts (127.0.0.1, the decode target's
    node) and on a host without a probe, which the GPU row must leave out."""
    registry = CollectorRegistry()
    names = ("gpu", "UUID", "device", "modelName", "Hostname")
    fields = {name: Gauge(name, name, names, registry=registry) for name in (
        "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_FAILURE")}
    children = {}
    for host, gpu in DCGM_GPUS:
        labels = {"gpu": gpu, "UUID": f"GPU-{host}-{gpu}", "device": f"nvidia{gpu}", "modelName": "NVIDIA H200", "Hostname": host}
        for name, gauge in fields.items():
            children[(name, host, gpu)] = gauge.labels(**labels)
            children[(name, host, gpu)].set(0)
    server, thread = start_exporter(0, LOOPBACK, registry)
    return children, server, thread


def drive_dcgm(children) -> None:
    children[("DCGM_FI_DEV_XID_ERRORS", DECODE_NODE, "1")].set(79)
    children[("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", DECODE_NODE, "1")].set(2)
    children[("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", DECODE_NODE, "1")].set(40)
    children[("DCGM_FI_DEV_XID_ERRORS", "other-node", "0")].set(48)


@pytest.fixture
def prometheus_binary():
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail("prometheus is not installed: run .ci/install-test-services.sh (make test does)")
    return path


def address(server) -> str:
    return f"{LOOPBACK}:{server.server_address[1]}"


def test_dashboard_alert_and_doc_queries_return_data_from_a_real_prometheus(prometheus_binary, tmp_path, monkeypatch):
    probes = {"prefill": start_probe("prefill", text=True), "decode": start_probe("decode"),
              "idle": start_probe("decode", hicache=False, text=True)}
    probes["broken"] = (None, *start_broken_probe(tmp_path, monkeypatch))
    probes["sglang"] = (None, *start_sglang_without_probe())
    dcgm, *dcgm_server = start_dcgm()
    servers = [(server, thread) for _, server, thread in probes.values()] + [tuple(dcgm_server)]
    at = {name: address(server) for name, (_, server, _) in probes.items()}
    site = {"cluster": "c1", "namespace": "serving"}
    prom = Prometheus(prometheus_binary, tmp_path, jobs={
        "dsv4-idxk-probe": [{"targets": [at["prefill"]], "labels": site},
                            {"targets": [at["decode"]], "labels": {**site, "node": DECODE_NODE}},
                            {"targets": [at["broken"], at["sglang"], at["idle"]]}],
        "dcgm-exporter": [{"targets": [address(dcgm_server[0])]}],
    })
    try:
        wait_for("prometheus to be ready", prom.ready)
        # Zero series scraped first, so increase() sees every event that follows.
        scraped_twice = '(count_over_time(up[1m]) >= 2) and (up == 1)'
        wait_for("all six exporters up and scraped twice", lambda: len(prom.series(scraped_twice)) == 6)
        (prefill, prefill_sglang), (decode, decode_sglang), (_, idle_sglang) = (probes[r][0] for r in ("prefill", "decode", "idle"))
        drive_prefill(prefill, prefill_sglang, len(PLANS))
        drive_decode(decode, decode_sglang, PLANS, tmp_path)
        idle_sglang.requests.inc(5)  # SGLang serves; the idle probe sees no transfer
        drive_dcgm(dcgm)
        wait_for("the mismatches scraped twice",
                 lambda: prom.series('count_over_time((dsv4_idxk_probe_rooms_verified_total{verdict="mismatch"} > 0)[1m:1s]) >= 2'))

        # Series born with an event (no zero series) need two raw samples before rate() sees them.
        def scraped_twice_each() -> bool:
            raw = prom.series('{__name__=~"dsv4_idxk_probe_(hicache|mismatch)_.*|sglang.kv_transfer_.*_bucket|DCGM_.*"}[1m]')
            return bool(raw) and all(len(series["values"]) >= 2 for series in raw)

        wait_for("every new series scraped twice", scraped_twice_each)

        def missing() -> list[str]:
            out = []
            for where, expr in panel_queries(load_dashboard()):
                query = substitute(strip_fallback(expr))
                answer = prom.query(query)
                if answer.get("status") != "success":
                    out.append(f"{where}: does not parse: {answer.get('error')}")
                elif not answer["data"]["result"]:
                    out.append(f"{where}: no series for {query}")
            for name, selector, label in variable_queries(load_dashboard()):
                found = prom.series(substitute(selector))
                if not any(s["metric"].get(label) for s in found):
                    out.append(f"variable {name}: no {label} values from {selector}")
            for rule in alert_rules():
                if not prom.series(rule["expr"]):
                    out.append(f"alert {rule['alert']}: no series for {rule['expr']}")
            for expr in doc_queries():
                if not prom.series(expr):
                    out.append(f"docs/observability.md: no series for {expr}")
            return out

        # A scrape that times out on a loaded machine marks its target's series stale until the
        # next one: ask again a few times before calling a query empty.
        for _ in range(5):
            failures = missing()
            if not failures:
                break
            time.sleep(2)
        assert not failures, "\n".join(failures)
        assert len(doc_queries()) >= 2

        panels = {p["title"]: p for p in load_dashboard()["panels"]}

        def value(title: str, **variables) -> float:
            (answer,) = prom.series(substitute(panels[title]["targets"][0]["expr"], **variables))
            return float(answer["value"][1])

        # Rooms, not stage verdicts: room 3 mismatched at two stages and room 4 at three.
        verdicts = prom.series('sum(dsv4_idxk_probe_rooms_verified_total{verdict="mismatch"})')
        assert float(verdicts[0]["value"][1]) > CORRUPT_ROOMS
        assert value("Mismatching rooms") == CORRUPT_ROOMS
        # All but the unverified room and the not-comparable one. A whole number; on series only
        # seconds old increase()'s extrapolation can add an event or two to counts this large.
        verified = value("Verified rooms")
        assert verified == int(verified) and len(PLANS) - 2 <= verified <= 1.5 * (len(PLANS) - 2)
        assert value("Mismatch ratio") == pytest.approx(CORRUPT_ROOMS / verified)
        (share,) = prom.series(substitute(panels["Coverage: verified share of index-K bytes by path"]["targets"][0]["expr"]))
        assert share["metric"]["path"] == "pd" and float(share["value"][1]) == pytest.approx(0.8)
        reasons = prom.series(substitute(panels["Unverified index-K bytes by reason"]["targets"][0]["expr"],
                                         __rate_interval="5m"))
        assert {(s["metric"]["outcome"], s["metric"]["reason"]) for s in reasons if float(s["value"][1]) > 0} \
            == {("unverified", "no_exchange"), ("not_comparable", "layout_differs")}

        # Prometheus 2.42 stores SGLang's names both ways: as-is from the text format, escaped from
        # prometheus_client's OpenMetrics exposition (what it asks for first). A query naming one
        # spelling would miss servers.
        stored = {s["metric"]["__name__"] for s in prom.series('{__name__=~"sglang[:_]num_requests_total"}')}
        assert stored == {"sglang:num_requests_total", "sglang_num_requests_total"}, stored
        # The join with SGLang's metrics as docs/observability.md had it: nothing, or an error.
        old = prom.query(OLD_DOC_JOIN)
        assert old.get("status") == "error" or not old["data"]["result"], old

        # The GPU row: the probes' hosts' GPUs (by instance, and by the decode target's node), not other-node's.
        xid = prom.series(substitute(panels["GPU XID errors"]["targets"][0]["expr"]))
        assert {s["metric"]["Hostname"] for s in xid} == {"127.0.0.1", DECODE_NODE}, xid
        xid = prom.series(substitute(panels["GPU XID errors"]["targets"][0]["expr"], instance=at["decode"]))
        assert {(s["metric"]["Hostname"], s["metric"]["gpu"], s["value"][1]) for s in xid} == {(DECODE_NODE, "0", "0"), (DECODE_NODE, "1", "79")}
        assert any(float(s["value"][1]) > 0 for s in prom.series(substitute(panels["GPU ECC double-bit errors"]["targets"][0]["expr"])))
        # Per GPU: each probe process beside its own GPU's DCGM counters (joined on UUID), no other GPU.
        per_gpu = panels["XID and ECC per probed GPU"]["targets"]
        xid = prom.series(substitute(per_gpu[0]["expr"]))
        assert {(s["metric"]["UUID"], s["metric"]["instance"], s["metric"]["gpu"], s["value"][1]) for s in xid} == {
            ("GPU-127.0.0.1-0", at["prefill"], "0", "0"), (f"GPU-{DECODE_NODE}-1", at["decode"], "1", "79")}, xid
        (dbe,) = prom.series(substitute(per_gpu[1]["expr"], instance=at["decode"]))
        assert dbe["metric"]["UUID"] == f"GPU-{DECODE_NODE}-1" and float(dbe["value"][1]) > 0

        # The idle server (no HiCache, no verdicts): every panel shows data, 0 or why it is empty.
        for title, panel in panels.items():
            if panel["type"] == "row":
                continue
            answers = [prom.series(substitute(t["expr"], instance=at["idle"])) for t in panel["targets"]]
            no_value = panel.get("fieldConfig", {}).get("defaults", {}).get("noValue")
            assert any(answers) or no_value, f"{title} says 'No data' for a healthy server without HiCache"
        assert value("HiCache pools", instance=at["idle"]) == 0
        assert value("Mismatching rooms", instance=at["idle"]) == 0
        # cluster and namespace: values where the scrape adds them, and "All" still matches the rest.
        assert value("Rooms digested on prefill", cluster="c1") >= len(PLANS)
        assert value("Rooms digested on prefill", cluster="elsewhere") == 0
        # (a second evaluation a moment later: increase() may extrapolate to another whole number)
        in_serving = value("Verified rooms", namespace="serving")
        assert in_serving == int(in_serving) and len(PLANS) - 2 <= in_serving <= 1.5 * (len(PLANS) - 2)
        assert value("Verified rooms", namespace="other") == 0

        rules = prom.get("/api/v1/rules")["data"]["groups"][0]["rules"]
        assert sorted(r["name"] for r in rules) == sorted(r["alert"] for r in alert_rules())
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]

        def alert_states():
            alerts = prom.get("/api/v1/alerts")["data"]["alerts"]
            return {(a["labels"]["alertname"], a["state"]) for a in alerts}

        expected = {("Dsv4IdxkProbeIndexKMismatch", "firing"), ("Dsv4IdxkProbeTokenPathOnNonC4Pool", "firing"),
                    ("Dsv4IdxkProbeRecordsDropped", "firing"), ("Dsv4IdxkProbeRequiredPatchTargetMissing", "pending"),
                    ("Dsv4IdxkProbeOffByError", "firing"), ("Dsv4IdxkProbeMetricsAbsent", "pending"),
                    ("Dsv4IdxkProbeErrors", "firing"), ("Dsv4IdxkProbeExchangeErrors", "firing"),
                    ("Dsv4IdxkProbeUnverifiedRatioHigh", "pending"), ("Dsv4IdxkProbeDecodeVerifiesNone", "pending"),
                    ("Dsv4IdxkProbeCoverageLow", "pending"), ("Dsv4IdxkProbeMismatchUnlocalised", "firing"),
                    ("Dsv4IdxkProbeHiCacheRestoreMismatch", "firing"), ("Dsv4IdxkProbeSideInactive", "firing")}
        wait_for(f"alerts {sorted(expected)}", lambda: expected <= alert_states(), timeout=15)
        alerts = prom.get("/api/v1/alerts")["data"]["alerts"]
        mine = lambda name: [a for a in alerts if a["labels"]["alertname"] == name]
        # Two corrupt rooms (first seen at decode_recv and at decode_step): one alert each, though
        # the decode_step room also mismatched at decode_finish; each counts its one room.
        assert sorted((a["labels"]["stage"], a["labels"]["corrupt_rooms"]) for a in mine("Dsv4IdxkProbeIndexKMismatch")) \
            == [("decode_recv", "1"), ("decode_step", "1")]
        (broken,) = mine("Dsv4IdxkProbeOffByError")
        (inactive,) = mine("Dsv4IdxkProbeSideInactive")
        assert (inactive["labels"]["instance"], inactive["labels"]["tp_rank"], inactive["labels"]["reason"]) \
            == (at["prefill"], "1", "build_failed")
        assert broken["labels"]["reason"] == "config_error" and broken["labels"]["tp_rank"] == "1"
        (absent,) = mine("Dsv4IdxkProbeMetricsAbsent")
        assert absent["labels"]["instance"] == at["sglang"]
        (idle,) = mine("Dsv4IdxkProbeDecodeVerifiesNone")
        assert idle["labels"]["instance"] == at["idle"]
        (unverified,) = mine("Dsv4IdxkProbeUnverifiedRatioHigh")
        assert unverified["labels"]["instance"] == at["decode"]
        # 8 of the 10 rooms verified (room 5 had no prefill digest, room 6 another layout)
        (low,) = mine("Dsv4IdxkProbeCoverageLow")
        assert (low["labels"]["instance"], low["labels"]["path"]) == (at["decode"], "pd")
        assert float(low["value"]) == pytest.approx(0.8)
        (unlocalised,) = mine("Dsv4IdxkProbeMismatchUnlocalised")
        assert (unlocalised["labels"]["instance"], unlocalised["labels"]["stage"]) == (at["decode"], "decode_recv")
        assert all(a["annotations"]["runbook_url"].endswith(f"/{a['labels']['alertname']}.md") for a in alerts)
        assert not [w for w, e in panel_queries(load_dashboard()) if is_external(e) and "$cluster" not in e]
    finally:
        prom.stop()
        for server, thread in servers:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
