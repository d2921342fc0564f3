"""The shipped dashboard's panels, run against a real Prometheus scraping the probe's real metrics,
read what an operator expects: a corrupt HiCache load shows on the red headline, and a server
with several TP ranks counts each room once.

Every attention-TP rank of a server gives its own verdict for a room (docs/coverage.md), and
SGLang's `/metrics` serves every scheduler rank of a server on one endpoint (its multiprocess
collector): the TP-2 servers here are two `ProbeMetrics`, one per rank, served together on one
endpoint. SGLang's request counter (its tokenizer's) has no rank. A TP-1 twin of each server is fed
the same rooms: every panel query that counts rooms must read the same on both.

Queries are asked at the time of each target's last scrape, after its zero series were scraped:
increase() then extrapolates neither to the window's start (the counter was 0 there) nor to its end,
so counts and rates are exact and compared exactly.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import Metric

from dsv4_idxk_probe.metrics.definitions import ProbeMetrics
from dsv4_idxk_probe.metrics.serving import start_exporter
from dsv4_idxk_probe.vocabulary import DECODE_STAGES, VERDICTS

from tests.support import prometheus_server
from tests.support.prometheus_server import LOOPBACK, Prometheus, wait_for
from tests.support.promql import load_dashboard, metric_names, substitute

MODEL = "dsv4-panels"
ROOMS = 6  # rooms of the clean decode server, each matching on both ranks
MIXED = {"match": 5, "mismatch": 1, "unverified": 1}  # rooms of the twins, every rank agreeing
LAYERS, PAGES = (3,), (0, 9)  # where the corrupt room differs
# The probe's counters of rooms (or of a room's pages): one rank's count is the server's.
ROOM_METRICS = {"dsv4_idxk_probe_rooms_verified_total", "dsv4_idxk_probe_rooms_digested_total",
                "dsv4_idxk_probe_first_divergence_total", "dsv4_idxk_probe_mismatch_layer_hits_total",
                "dsv4_idxk_probe_mismatch_page_bucket_hits_total"}


class OneEndpoint:
    """Several ranks' registries as one /metrics, as SGLang's multiprocess collector serves them."""

    def __init__(self, registries):
        self.registries = registries

    def collect(self):
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                merged.samples.extend(family.samples)
        return list(families.values())


class Server:
    """One SGLang server of `ranks` TP ranks, each with the probe's metrics built as activation builds
    them (zero series), and SGLang's tokenizer request counter on decode."""

    def __init__(self, engine_type: str, ranks: int):
        registries = [CollectorRegistry() for _ in range(ranks)]
        self.ranks = [ProbeMetrics(r, labels={"model_name": MODEL, "engine_type": engine_type, "tp_rank": str(i),
                                               "pp_rank": "0", "moe_ep_rank": "0"})
                      for i, r in enumerate(registries)]
        self.requests = None
        for m in self.ranks:
            m.zero_pd_series()
            if engine_type == "prefill":  # a HiCache index-K pool's load verdicts at zero (hicache/probe.py)
                for verdict in VERDICTS:
                    m.rooms_verified.labels(stage="hicache_load", verdict=verdict)
            else:  # the localisation heat of the room that will mismatch, at zero, so increase() sees it
                for stage in DECODE_STAGES:
                    for layer in LAYERS:
                        m.mismatch_layer_hits.labels(stage=stage, layer=str(layer))
                    for bucket in ("0", "8"):
                        m.mismatch_page_bucket_hits.labels(stage=stage, page_bucket=bucket)
        if engine_type == "decode":
            labels = {"model_name": MODEL, "engine_type": engine_type}
            self.requests = Counter("sglang:num_requests_total", "Number of requests processed.", [*labels, "is_streaming"],
                                    registry=registries[0]).labels(**labels, is_streaming="false")
        merged = CollectorRegistry()
        merged.register(OneEndpoint(registries))
        self.server, self.thread = start_exporter(0, LOOPBACK, merged)
        self.address = f"{LOOPBACK}:{self.server.server_address[1]}"

    def decode_rooms(self, verdicts: dict[str, int]) -> None:
        """Rooms, each judged alike by every rank (as the decode monitor counts them, pd/decode.py)."""
        for m in self.ranks:
            for verdict, n in verdicts.items():
                for _ in range(n):
                    stages = DECODE_STAGES if verdict != "unverified" else DECODE_STAGES[:1]
                    for stage in stages:
                        m.rooms_digested.labels(stage=stage).inc()
                        m.rooms_verified.labels(stage=stage, verdict=verdict).inc()
                        if verdict == "mismatch":
                            m.observe_localisation(stage, LAYERS, PAGES)
                    if verdict == "mismatch":
                        m.first_divergence.labels(stage=DECODE_STAGES[0]).inc()
        self.requests.inc(sum(verdicts.values()))

    def prefill_rooms(self, n: int, corrupt_loads: int) -> None:
        """`n` rooms digested as they leave, and HiCache loads (hicache/probe.py _on_restore): three
        that matched their backup and `corrupt_loads` that did not, on every rank (a wrong row
        geometry hits every rank's copy alike)."""
        for m in self.ranks:
            m.rooms_digested.labels(stage="prefill_send").inc(n)
            m.rooms_verified.labels(stage="hicache_load", verdict="match").inc(3)
            m.rooms_verified.labels(stage="hicache_load", verdict="mismatch").inc(corrupt_loads)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class Live:
    def __init__(self, prom: Prometheus, servers: dict[str, Server]):
        self.prom, self.servers = prom, servers
        self.panels = {p["title"]: p for p in load_dashboard()["panels"]}
        self.at = {}

    def freeze(self, since: float) -> None:
        """Each target's last scrape, once every target has been scraped after `since`."""
        def scraped() -> dict | None:
            found = {s["metric"]["instance"]: float(s["value"][1]) for s in self.prom.series("timestamp(up)")}
            if all(found.get(s.address, 0) > since for s in self.servers.values()):
                return found
            return None

        found = wait_for("every target scraped after the rooms", scraped, timeout=15, every=0.1)
        self.at = {name: found[s.address] for name, s in self.servers.items()}

    def ask(self, expr: str, server: str | None = None, **variables) -> list[dict]:
        """`expr` with the variables filled in (instance = `server`'s, else All), at `server`'s last
        scrape (else the latest of them)."""
        if server is not None:
            variables.setdefault("instance", self.servers[server].address)
        when = self.at[server] if server is not None else max(self.at.values())
        answer = self.prom.get("/api/v1/query", query=substitute(expr, **variables), time=f"{when:.3f}")
        assert answer.get("status") == "success", (expr, answer)
        return answer["data"]["result"]

    def value(self, title: str, server: str | None = None, **variables) -> float:
        (answer,) = self.ask(self.panels[title]["targets"][0]["expr"], server, **variables)
        return float(answer["value"][1])


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed: run .ci/install-test-services.sh (make test does)")
    tmp = tmp_path_factory.mktemp("panels")
    (tmp / "no-rules.yml").write_text(json.dumps({"groups": []}))  # the panels need no alert rules
    servers = {"decode-tp2": Server("decode", 2), "decode-mixed-tp2": Server("decode", 2),
               "decode-mixed-tp1": Server("decode", 1), "prefill-tp2": Server("prefill", 2),
               "prefill-tp1": Server("prefill", 1)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prometheus_server, "ALERTS", tmp / "no-rules.yml")
        prom = Prometheus(binary, tmp, [s.address for s in servers.values()])
    try:
        wait_for("prometheus to be ready", prom.ready)
        # zero series scraped first, so increase() sees every room that follows (Prometheus applies
        # its targets some 5 s after it starts: most of this test's time)
        wait_for("every target scraped", lambda: len(prom.series("up == 1")) == len(servers))
        servers["decode-tp2"].decode_rooms({"match": ROOMS})
        for twin in ("decode-mixed-tp2", "decode-mixed-tp1"):
            servers[twin].decode_rooms(MIXED)
        for twin in ("prefill-tp2", "prefill-tp1"):
            servers[twin].prefill_rooms(sum(MIXED.values()), corrupt_loads=1)
        done = time.time()
        live = Live(prom, servers)
        live.freeze(done)
        yield live
    finally:
        prom.stop()
        stopping = [threading.Thread(target=server.stop) for server in servers.values()]  # each waits for its poll
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()


def headline() -> list[str]:
    """The red stats at the top of the dashboard (the verification row's first line)."""
    dash = load_dashboard()["panels"]
    top = min(p["gridPos"]["y"] for p in dash if p["type"] != "row")
    return [p["title"] for p in dash if p["type"] == "stat" and p["gridPos"]["y"] == top
            and "red" in [step["color"] for step in p["fieldConfig"]["defaults"].get("thresholds", {}).get("steps", [])]]


def test_a_corrupt_hicache_load_shows_red_on_the_headline(live):
    """What Dsv4IdxkProbeHiCacheRestoreMismatch fires on: the dashboard's headline read 0 for it
    ("Mismatching rooms" counts PD first divergences only)."""
    red = headline()
    assert red, "no red stat on the headline"
    assert [live.value(title, "prefill-tp2") for title in red if live.value(title, "prefill-tp2") > 0] == [1.0], \
        {title: live.value(title, "prefill-tp2") for title in red}
    # "All" servers: one load on each prefill server (one event a series: increase() cannot add a whole one)
    assert any(live.value(title, None, engine_type="prefill") == 2 for title in red)
    # a clean server reads 0 on every red stat
    assert {title: live.value(title, "decode-tp2") for title in red} == {title: 0 for title in red}


def test_a_tp2_decode_whose_rooms_match_on_both_ranks_reads_100_percent_and_n_rooms(live):
    """SGLang counts a request once; each of the 2 ranks gives its verdict for the room: the
    coverage read 200% and the verified rooms 2N."""
    assert live.value("Verification coverage", "decode-tp2") == 1.0
    assert live.value("Verified rooms", "decode-tp2") == ROOMS
    assert live.value("Mismatching rooms", "decode-tp2") == 0
    assert live.value("Mismatch ratio", "decode-tp2") == 0
    # the other variables still narrow it
    assert live.value("Verified rooms", "decode-tp2", engine_type="decode", model_name=MODEL, job=".+") == ROOMS
    assert live.value("Verification coverage", "decode-tp2", engine_type="decode", model_name=MODEL) == 1.0
    assert live.value("Verified rooms", "decode-tp2", engine_type="prefill") == 0
    assert live.value("Verified rooms", "decode-tp2", model_name="another-model") == 0
    (requests, rooms) = (live.ask(t["expr"], "decode-tp2")
                         for t in live.panels["Decode requests and verified rooms"]["targets"])
    assert [float(s["value"][1]) for s in rooms] == [float(s["value"][1]) for s in requests] != [0.0]


def test_a_tp2_server_counts_each_room_once_as_its_tp1_twin(live):
    """Every panel query that counts rooms reads on a TP-2 server what it reads on a TP-1 server fed
    the same rooms (label sets without the instance, and values)."""
    def read(expr: str, server: str) -> dict:
        out = {}
        for s in live.ask(expr, server):
            labels = {k: v for k, v in s["metric"].items() if k not in ("instance", "__name__")}
            out[json.dumps(labels, sort_keys=True)] = float(s["value"][1])
        return out

    asked, differ = [], []
    for title, panel in live.panels.items():
        for t in panel.get("targets", []):
            if not metric_names(t["expr"]) & ROOM_METRICS:
                continue
            for kind, (two, one) in (("decode", ("decode-mixed-tp2", "decode-mixed-tp1")), ("prefill", ("prefill-tp2", "prefill-tp1"))):
                tp2, tp1 = read(t["expr"], two), read(t["expr"], one)
                asked.append(f"{title} / {t['refId']} ({kind})")
                if tp2 != tp1:
                    differ.append(f"{title} / {t['refId']} on {kind}: TP 2 {tp2}, TP 1 {tp1}")
    assert len(asked) >= 2 * 12, asked
    assert not differ, "\n".join(differ)
    assert live.value("Mismatching rooms", "decode-mixed-tp2") == MIXED["mismatch"]
    verified = MIXED["match"] + MIXED["mismatch"]
    assert live.value("Verified rooms", "decode-mixed-tp2") == verified
    assert live.value("Mismatch ratio", "decode-mixed-tp2") == pytest.approx(MIXED["mismatch"] / verified)
    assert live.value("Unverified or not comparable", "decode-mixed-tp2") == MIXED["unverified"]
    assert live.value("Rooms digested on prefill", "prefill-tp2") == sum(MIXED.values())
