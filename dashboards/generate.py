#!/usr/bin/env python3
"""Write the dsv4-idxk-probe Grafana dashboard (dashboards/dsv4-idxk-probe.json).

The JSON is generated, never edited by hand: change this file and run
``python dashboards/generate.py``. ``--check`` exits 1 when the checked-in JSON
differs from what this script writes (the test suite runs the same check),
type-checks the JSON against Grafana's own schema (``@grafana/schema``), and
sends every query below to a real Prometheus holding scraped fixtures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUTPUT = Path(__file__).with_name("dsv4-idxk-probe.json")
UID = "dsv4-idxk-probe"
P = "dsv4_idxk_probe_"
RED, GREEN, ORANGE, GREY = "red", "green", "orange", "text"
TOKEN_PATH_ON_INDEXER = "/.*indexer.* token.*/"  # legend "<pool> <direction> <branch>"
# SGLang's own dashboard (its examples/monitoring/grafana/dashboards/json/sglang-dashboard.json).
SGLANG_DASHBOARD_UID = "sglang-dashboard"
# Template variables, in dependency order; each filters every probe query. cluster and
# namespace exist only where the scrape adds them (kube-prometheus, a multi-cluster
# Thanos/Mimir): without them their "All" (.*) also matches the missing label.
VARIABLES = ("cluster", "namespace", "job", "instance", "engine_type", "model_name")
# What a query appends when an empty answer means zero (a stat shows 0 instead of
# "No data"); the live test strips it to check the real query returns data.
ZERO = " or vector(0)"
NO_MISMATCH = "no mismatches in range"
NO_HICACHE = "no HiCache pools on the selected servers"
NO_SGLANG = "no SGLang PD metrics on the selected servers"
NO_DCGM = "no DCGM metrics for the probed nodes (see docs/observability.md)"
# SGLang's rank labels (metrics/definitions.py, PROCESS_LABELS). Every attention-TP rank of a server
# gives its own verdict for the same room (and restores its own copy in the same HiCache load;
# docs/coverage.md), and with PP each stage digests its layers of it: a sum over these labels counts
# one room once per rank (TP 2 read 200% coverage, twice the verified rooms). Room counts are taken
# once per server (once_per_server). dp_rank is not among them: each attention-DP group serves rooms
# of its own, and they add up.
RANKS = ("tp_rank", "pp_rank", "moe_ep_rank")


def matchers(names=VARIABLES) -> list[str]:
    return [f'{name}=~"${name}"' for name in names]


def sel(*extra: str) -> str:
    """Label matchers every probe query carries: the template variables, plus `extra`."""
    return "{" + ",".join([*matchers(), *extra]) + "}"


def sg(name: str, *extra: str) -> str:
    """An SGLang series by SGLang's own name ("sglang:<name>"), with the template variables.

    SGLang registers its metrics as ``sglang:<name>``. What Prometheus stores depends on
    the exposition it negotiated: the text format and Prometheus 3 (UTF-8) keep the colon;
    the OpenMetrics exposition of prometheus_client >= 0.22, which Prometheus 2.x asks for
    first, escapes it to ``sglang_<name>``. The regex matches both.
    """
    return "{" + ",".join([f'__name__=~"sglang[:_]{name}"', *matchers(), *extra]) + "}"


def rate(metric: str, by: str, *extra: str) -> str:
    return f"sum by ({by}) (rate({P}{metric}{sel(*extra)}[$__rate_interval]))"


def increase(metric: str, by: str, *extra: str, window: str = "$__rate_interval") -> str:
    return f"sum by ({by}) (increase({P}{metric}{sel(*extra)}[{window}]))"


def once_per_server(expr: str, merge: str = "") -> str:
    """`expr` (one series per rank: room counts or rates) with each room once per server.

    The ranks of a server each count the same room (RANKS), so the ranks are not added up: the
    rank that counted most stands for the server (``max without`` the rank labels, which keeps
    instance, dp_rank and every other label). `merge` names the labels that split one room's
    count within a rank (its verdicts, its stages); they are added up first, so a room one rank
    judged match and another mismatch counts once, not once per verdict. Two ranks that each
    found a different corrupt room read 1: the room logs (`dsv4-idxk-probe report`) list rooms.
    """
    if merge:
        expr = f"sum without ({merge}) ({expr})"
    return f"max without ({', '.join(RANKS)}) ({expr})"


def room_rate(metric: str, by: str, *extra: str, merge: str = "") -> str:
    """Rooms per second by `by`, each room once per server (once_per_server)."""
    return f"sum by ({by}) ({once_per_server(f'rate({P}{metric}{sel(*extra)}[$__rate_interval])', merge)})"


def room_increase(metric: str, by: str, *extra: str) -> str:
    """Rooms (or pages) per rate interval by `by`, each once per server (once_per_server)."""
    return f"sum by ({by}) ({once_per_server(f'increase({P}{metric}{sel(*extra)}[$__rate_interval])')})"


def count_in_range(metric: str, *extra: str, merge: str = "") -> str:
    """Rooms over the dashboard's range, as a whole number, each room once per server
    (once_per_server; `merge` as there).

    increase() extrapolates to the window's edges (11 events can read 11.3); it never
    reads below the events between the window's first and last samples, so flooring
    each series gives that count exactly while the extrapolation adds less than one
    event per series (a series scraped every 15 s over 1 h: fewer than 240 events).
    """
    return f"sum({once_per_server(f'floor(increase({P}{metric}{sel(*extra)}[$__range]))', merge)})"


def quantile(q: float, metric: str) -> str:
    return f"histogram_quantile({q}, sum by (le, stage) (rate({P}{metric}_bucket{sel()}[$__rate_interval])))"


def with_host(expr: str) -> str:
    """`expr` with a ``Hostname`` label, as DCGM's exporter labels its GPUs: the ``node``
    label where the scrape adds one (configs/kubernetes/podmonitor.yaml does), else the
    host part of ``instance`` (host:port)."""
    from_instance = f'label_replace({expr}, "Hostname", "$1", "instance", "(.+?)(?::[0-9]+)?")'
    return f'label_replace({from_instance}, "Hostname", "$1", "node", "(.+)")'


def probe_hosts() -> str:
    """One series per host that runs a selected probe process, labelled ``Hostname``."""
    return f"group by (Hostname) ({with_host(P + 'info' + sel())})"


def dcgm(expr: str) -> str:
    """A DCGM query (by Hostname and gpu) kept to the hosts of the selected probes."""
    return f"{expr} * on (Hostname) group_left () {probe_hosts()}"


def probe_gpus() -> str:
    """One series per (GPU, probe process) of the selected probes, labelled ``UUID`` as DCGM's
    exporter labels its GPUs (dsv4_idxk_probe_gpu_info's gpu_uuid: metrics/gpu_identity.py)."""
    info = f'label_replace({P}gpu_info{sel()}, "UUID", "$1", "gpu_uuid", "(.+)")'
    return f"max by (UUID, instance, engine_type, tp_rank, hostname) ({info})"


def per_probed_gpu(dcgm_expr: str) -> str:
    """A DCGM series per GPU UUID, beside the probe processes on that very GPU: the probe's side
    is the "many" one (two processes may share a GPU), DCGM's one series per UUID the "one"."""
    return f"{probe_gpus()} * on (UUID) group_left (Hostname, gpu) ({dcgm_expr})"


def target(expr: str, legend: str, ref: str = "A", **kw) -> dict:
    return {"datasource": {"type": "prometheus", "uid": "${datasource}"}, "expr": expr, "legendFormat": legend, "refId": ref, **kw}


def colour_override(matcher: dict, colour: str) -> dict:
    return {"matcher": matcher, "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": colour}}]}


def by_name(name: str) -> dict:
    return {"id": "byName", "options": name}


def by_regexp(pattern: str) -> dict:
    return {"id": "byRegexp", "options": pattern}


class Layout:
    """Hands out gridPos left to right, wrapping at Grafana's 24 columns."""

    def __init__(self):
        self.x = self.y = self.row_h = 0
        self.next_id = 1

    def place(self, w: int, h: int) -> dict:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        pos = {"x": self.x, "y": self.y, "w": w, "h": h}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos

    def newline(self) -> None:
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def thresholds(*steps: tuple) -> dict:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in steps]}


def series(unit: str = "short", overrides: list | None = None, stack: bool = False, no_value: str | None = None) -> dict:
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
    if stack:
        custom["stacking"] = {"mode": "normal"}
    defaults = {"unit": unit, "custom": custom}
    if no_value:
        defaults["noValue"] = no_value
    return {"fieldConfig": {"defaults": defaults, "overrides": overrides or []},
            "options": {"legend": {"displayMode": "table", "placement": "right", "calcs": ["sum"]}, "tooltip": {"mode": "multi"}}}


def stat(colour: str | None = None, unit: str = "short", mappings: list | None = None, graph: str = "none") -> dict:
    """A stat panel's fieldConfig and options: green, and `colour` from 1 (or any value
    above 0 for a ratio) when `colour` is given."""
    defaults: dict = {"unit": unit}
    if colour:
        first = 1 if unit == "short" else 1e-9
        defaults |= {"thresholds": thresholds((GREEN, None), (colour, first)), "color": {"mode": "thresholds"}}
    if mappings:
        defaults["mappings"] = mappings
    return {"fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"colorMode": "background" if colour else "none", "graphMode": graph,
                        "reduceOptions": {"calcs": ["lastNotNull"]}}}


def panels() -> list[dict]:
    grid = Layout()
    out: list[dict] = []

    def row(title: str) -> None:
        grid.newline()
        out.append({"type": "row", "title": title, "id": grid.new_id(), "collapsed": False, "gridPos": grid.place(24, 1), "panels": []})

    def panel(kind: str, title: str, description: str, targets: list[dict], w: int, h: int = 8, **extra) -> None:
        out.append(
            {
                "type": kind,
                "title": title,
                "description": description,
                "id": grid.new_id(),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": grid.place(w, h),
                "targets": targets,
                **extra,
            }
        )

    def heat(label: str, metric: str, what: str) -> None:
        panel(
            "heatmap",
            f"Localisation heat: {what}",
            f"Mismatches per {what} over time (counter {P}{metric}), each once per server however many of "
            "its ranks saw it. Page heat is by power-of-two page bucket (labels never carry a page); exact "
            "(layer, page) cells are in `dsv4-idxk-probe report`.",
            [target(room_increase(metric, label), f"{{{{{label}}}}}", format="time_series")],
            12,
            fieldConfig={"defaults": {"noValue": NO_MISMATCH}, "overrides": []},
            options={"calculate": False, "yAxis": {"axisLabel": what}, "rowsFrame": {"layout": "auto"},
                     "color": {"mode": "scheme", "scheme": "Reds", "exponent": 0.5}, "cellGap": 1,
                     "tooltip": {"show": True, "yHistogram": False}},
        )

    verified_rooms = ('stage="decode_recv"', 'verdict=~"match|mismatch"')
    checked_rooms = ('stage="decode_recv"', 'verdict!="skipped"')
    decode_requests = sg("num_requests_total", 'engine_type="decode"')

    row("Verification (prefill -> decode)")
    once = ("Each room counts once per server, however many of its TP ranks verified it (each gives its own "
            "verdict).")
    mismatching_rooms = count_in_range("first_divergence_total", merge="stage")
    verified_count = count_in_range("rooms_verified_total", *verified_rooms, merge="verdict")
    panel("stat", "Mismatching rooms",
          "Corrupt rooms over the dashboard range: rooms whose decode digest differed from prefill's, each counted "
          f"once, at the first decode stage that saw it ({P}first_divergence_total, what the mismatch alert reads; "
          f"a room still corrupt at later stages is not counted again). {once} A corrupt HiCache load is not "
          "counted here (prefill sends the restored bytes, so every PD stage matches): see HiCache corrupt loads. "
          "Red above zero.",
          [target(mismatching_rooms + ZERO, "rooms", instant=True)], 4, 5, **stat(RED))
    # The other corruption the probe finds: a HiCache load that wrote index-K differing from what its
    # backup read (the Dsv4IdxkProbeHiCacheRestoreMismatch alert). Prefill digests the restored bytes
    # and sends them, so every PD stage matches and "Mismatching rooms" reads 0 while that critical
    # alert fires. It gets a red stat of its own beside it rather than being added in: a load is not
    # a PD room (the mismatch ratio is per verified PD room), and its culprit and runbook differ (the
    # host pool, not the transfer). Its title starts with "HiCache", as the HiCache row's, so checks
    # of a server without host pools (the demo rig) leave it out as they leave that row out.
    panel("stat", "HiCache corrupt loads",
          "HiCache loads (host pool to device) over the range that wrote index-K differing from what their backup "
          f"read ({P}rooms_verified_total{{stage=\"hicache_load\", verdict=\"mismatch\"}}, what the "
          "Dsv4IdxkProbeHiCacheRestoreMismatch alert reads). Prefill then digests and sends the corrupt bytes, so "
          "Mismatching rooms stays 0. Each load counts once per server, however many of its TP ranks restored "
          "it. The prefill room log's restore_mismatch records localise it. Red above zero.",
          [target(count_in_range("rooms_verified_total", 'stage="hicache_load"', 'verdict="mismatch"') + ZERO,
                  "loads", instant=True)], 4, 5, **stat(RED))
    panel("stat", "Mismatch ratio",
          "Mismatching rooms / verified rooms over the range. Verified: rooms whose decode_recv digest was compared "
          f"with prefill's (match or mismatch). {once} Red above zero.",
          [target(f"({mismatching_rooms} / clamp_min({verified_count}, 1))" + ZERO, "ratio", instant=True)],
          4, 5, **stat(RED, unit="percentunit"))
    panel("stat", "Verified rooms", "Rooms whose decode_recv digest was compared with prefill's (match or mismatch), "
          f"over the range. {once}",
          [target(verified_count + ZERO, "rooms", instant=True)], 4, 5, **stat(graph="area"))
    panel("stat", "Unverified or not comparable",
          "Room-stages with no prefill digest in time, or with a different layout signature, over the range (each "
          "once per server, however many of its ranks gave that verdict).",
          [target(count_in_range("rooms_verified_total", 'verdict=~"unverified|not_comparable"', merge="verdict") + ZERO,
                  "room-stages", instant=True)],
          4, 5, **stat(ORANGE))
    panel("stat", "Rooms digested on prefill", "Rooms whose index-K prefill digested as it left, over the range "
          "(each once per server, however many of its ranks digested it).",
          [target(count_in_range("rooms_digested_total", 'stage="prefill_send"') + ZERO, "rooms", instant=True)], 4, 5,
          **stat(graph="area"))
    panel("timeseries", "Verified rooms by stage and verdict", "Decode-stage (and HiCache load) verdicts per second, "
          "each room once per server however many of its ranks verified it.",
          [target(room_rate("rooms_verified_total", "stage, verdict"), "{{stage}} {{verdict}}")], 12,
          **series("ops", [colour_override(by_regexp("/.* mismatch/"), RED), colour_override(by_regexp("/.* not_comparable/"), ORANGE),
                           colour_override(by_regexp("/.* unverified/"), GREY)], stack=True))
    panel("bargauge", "First-divergence stage", "Mismatching rooms by the earliest decode stage whose digest differed "
          "(decode_recv: corrupt in transfer; decode_step/finish: corrupted after receipt), over the range, each "
          "room once per server.",
          [target(f"sum by (stage) ({once_per_server(f'floor(increase({P}first_divergence_total{sel()}[$__range]))')})",
                  "{{stage}}", instant=True)], 6,
          options={"orientation": "horizontal", "displayMode": "basic", "reduceOptions": {"calcs": ["lastNotNull"]}},
          fieldConfig={"defaults": {"color": {"mode": "fixed", "fixedColor": RED}, "unit": "short", "noValue": NO_MISMATCH}, "overrides": []})
    panel("timeseries", "Mismatching cells by segment", "Differing (layer, page) cells per second, by row segment (payload, scale, ...).",
          [target(rate("mismatch_cells_total", "stage, segment"), "{{stage}} {{segment}}")], 6, **series("ops", no_value=NO_MISMATCH))
    heat("layer", "mismatch_layer_hits_total", "layer")
    heat("page_bucket", "mismatch_page_bucket_hits_total", "page bucket")
    panel("timeseries", "Unverified and not-comparable rooms", "Unverified: no prefill digest in time. Not comparable: "
          "layout signatures differ (a rolling upgrade, not corruption). Each room once per server.",
          [target(room_rate("rooms_verified_total", "stage, verdict", 'verdict=~"unverified|not_comparable"'),
                  "{{stage}} {{verdict}}")], 12,
          **series("ops", [colour_override(by_regexp("/.* not_comparable/"), ORANGE)]))
    panel("timeseries", "Verify latency p99", "From a decode digest's enqueue to its verdict.",
          [target(quantile(0.99, "verify_latency_seconds"), "p99 {{stage}}")], 12, **series("s", no_value="no decode digests in range"))

    row("Coverage (every index-K byte moved: verified, or why not)")
    moved = increase("coverage_bytes_total", "path", window="$__range")
    verified_bytes = increase("coverage_bytes_total", "path", 'outcome="verified"', window="$__range")
    panel("bargauge", "Coverage: verified share of index-K bytes by path",
          "Index-K bytes verified / bytes moved, per path, over the range (dsv4_idxk_probe_coverage_bytes_total; "
          "docs/coverage.md). pd is counted by decode, once per room (a mismatch is verified bytes found bad); the "
          "HiCache paths by the side that restores. Below 99% the Dsv4IdxkProbeCoverageLow alert fires; the next "
          "panel says why.",
          [target(f"{verified_bytes} / ({moved} > 0)",
                  "{{path}}", instant=True)], 8,
          options={"orientation": "horizontal", "displayMode": "basic", "reduceOptions": {"calcs": ["lastNotNull"]}},
          fieldConfig={"defaults": {"unit": "percentunit", "min": 0, "max": 1, "noValue": "no index-K moved in range",
                                    "color": {"mode": "thresholds"},
                                    "thresholds": thresholds((RED, None), (ORANGE, 0.9), (GREEN, 0.99))}, "overrides": []})
    panel("timeseries", "Unverified index-K bytes by reason",
          "Bytes per second moved without a verification, by path, outcome (unverified, not_comparable, skipped) and "
          "reason (no_exchange, pp_stage, truncated_by_transfer, host_dest, layout_unknown, ...; docs/coverage.md "
          "says what each means and what to do).",
          [target(rate("coverage_bytes_total", "path, outcome, reason", 'outcome!="verified"'),
                  "{{path}} {{outcome}} {{reason}}")], 16,
          **series("Bps", [colour_override(by_regexp("/.* not_comparable .*/"), ORANGE)], stack=True))

    row("SGLang PD (SGLang's own metrics, beside the probe's)")
    panel("timeseries", "Decode requests and verified rooms",
          "Requests SGLang's decode servers finished (sglang:num_requests_total, engine_type decode) next to the rooms "
          "the probe verified there at decode_recv (any verdict but skipped), each room once per server however many "
          "of its TP ranks verified it. Verified falling below requests means rooms going unchecked (the "
          "Dsv4IdxkProbeDecodeVerifiesNone alert).",
          [target(f"sum by (instance) (rate({decode_requests}[$__rate_interval]))", "{{instance}} SGLang decode requests"),
           target(room_rate("rooms_verified_total", "instance", *checked_rooms, merge="verdict"), "{{instance}} rooms verified", "B")],
          10, **series("ops", no_value=NO_SGLANG))
    panel("stat", "Verification coverage",
          "Rooms the probe verified at decode_recv (any verdict but skipped) per request SGLang's decode servers "
          "finished, over the range. Each room counts once per server, however many of its TP ranks verified it "
          "(SGLang counts a request once, on its tokenizer, with no rank).",
          [target(f"{count_in_range('rooms_verified_total', *checked_rooms, merge='verdict')} "
                  f"/ sum(floor(increase({decode_requests}[$__range])))",
                  "coverage", instant=True)],
          4, 8, fieldConfig={"defaults": {"unit": "percentunit", "noValue": NO_SGLANG, "color": {"mode": "thresholds"},
                                          "thresholds": thresholds((ORANGE, None), (GREEN, 0.99))}, "overrides": []},
          options={"colorMode": "background", "graphMode": "none", "reduceOptions": {"calcs": ["lastNotNull"]}})
    panel("timeseries", "KV transfer and bootstrap failures",
          "Requests SGLang failed in KV transfer or bootstrap (sglang:num_transfer_failed_reqs_total, "
          "sglang:num_bootstrap_failed_reqs_total), per second: a failed transfer is aborted, a corrupt one is what the "
          "probe catches.",
          [target(f"sum by (instance, engine_type) (rate({sg('num_transfer_failed_reqs_total')}[$__rate_interval]))",
                  "{{engine_type}} {{instance}} transfer failed"),
           target(f"sum by (instance, engine_type) (rate({sg('num_bootstrap_failed_reqs_total')}[$__rate_interval]))",
                  "{{engine_type}} {{instance}} bootstrap failed", "B")],
          10, **series("ops", [colour_override(by_regexp("/.*failed/"), RED)], no_value=NO_SGLANG))
    panel("timeseries", "KV transfer latency p99",
          "SGLang's KV transfer latency and bootstrap time, p99 (sglang:kv_transfer_latency_ms, "
          "sglang:kv_transfer_bootstrap_ms; observed on prefill).",
          [target(f"histogram_quantile(0.99, sum by (le, instance) (rate({sg('kv_transfer_latency_ms_bucket')}[$__rate_interval])))",
                  "{{instance}} transfer p99"),
           target(f"histogram_quantile(0.99, sum by (le, instance) (rate({sg('kv_transfer_bootstrap_ms_bucket')}[$__rate_interval])))",
                  "{{instance}} bootstrap p99", "B")],
          12, **series("ms", no_value=NO_SGLANG))
    panel("timeseries", "PD queues",
          "Requests waiting in SGLang's PD queues: prefill bootstrap and in-flight (sending KV), decode prealloc and "
          "transfer (receiving KV).",
          [target(f"sum by (instance) ({sg(name)})", f"{{{{instance}}}} {legend}", ref)
           for ref, name, legend in (("A", "num_prefill_bootstrap_queue_reqs", "prefill bootstrap"),
                                     ("B", "num_prefill_inflight_queue_reqs", "prefill in flight"),
                                     ("C", "num_decode_prealloc_queue_reqs", "decode prealloc"),
                                     ("D", "num_decode_transfer_queue_reqs", "decode transfer"))],
          12, **series("short", no_value=NO_SGLANG))

    row("HiCache host pools")
    panel("stat", "HiCache pools", "Host pools the probe watches on the selected servers (dsv4_idxk_probe_hicache_pool_info); "
          "0 where HiCache is off, which is healthy.",
          [target(f"count(max by (instance, pool) ({P}hicache_pool_info{sel()}))" + ZERO, "pools", instant=True)], 4,
          **stat(mappings=[{"type": "value", "options": {"0": {"text": "none (HiCache off)", "index": 0}}}]))
    panel("timeseries", "HiCache branch hits per pool", "Host-pool copy calls by branch. Red: the token-granular path on an indexer pool, "
          "which applies the C4 row geometry to rows that are not C4 rows.",
          [target(rate("hicache_copies_total", "pool, direction, branch"), "{{pool}} {{direction}} {{branch}}")], 10,
          **series("ops", [colour_override(by_regexp(TOKEN_PATH_ON_INDEXER), RED)], no_value=NO_HICACHE))
    panel("timeseries", "Guard and index-check violations", "Token-path guard hits, index groups that are not whole aligned in-range pages, failed pool invariants.",
          [target(increase("hicache_guard_total", "pool, action"), "guard {{pool}} {{action}}"),
           target(increase("hicache_index_violations_total", "pool, direction, check"), "index {{pool}} {{direction}} {{check}}", "B"),
           target(increase("hicache_invariant_violations_total", "pool, invariant"), "invariant {{pool}} {{invariant}}", "C")], 10,
          **series("short", [colour_override(by_regexp("/.*/"), RED)], no_value=NO_HICACHE))
    panel("timeseries", "HiCache round-trip checks", "Opt-in round-trip digests of host-pool rows, by leg and verdict.",
          [target(rate("hicache_roundtrip_total", "pool, leg, verdict"), "{{pool}} {{leg}} {{verdict}}")], 12,
          **series("ops", [colour_override(by_regexp("/.* mismatch/"), RED)], no_value=NO_HICACHE + " or no round-trip checks"))
    panel("timeseries", "HiCache pages moved", "Pages moved by host-pool copies, per pool and direction.",
          [target(rate("hicache_pages_total", "pool, direction"), "{{pool}} {{direction}}")], 12, **series("ops", no_value=NO_HICACHE))

    row("GPU health (DCGM, on the probed nodes)")
    join = ("DCGM's series are kept to the hosts of the selected probe processes: DCGM's Hostname label must equal the "
            "probe's node label (added by configs/kubernetes/podmonitor.yaml) or the host part of its instance.")
    panel("timeseries", "GPU XID errors", "Last XID error per GPU (DCGM_FI_DEV_XID_ERRORS; 0: none since the exporter started). "
          "48, 63, 64, 74, 79, 92-95 are memory, NVLink or fallen-off-the-bus errors that can corrupt KV. " + join,
          [target(dcgm(f'max by (Hostname, gpu) (DCGM_FI_DEV_XID_ERRORS{{cluster=~"$cluster"}})'), "{{Hostname}} GPU {{gpu}}")], 6,
          **series("none", [colour_override(by_regexp("/.*/"), RED)], no_value=NO_DCGM))
    panel("timeseries", "GPU ECC double-bit errors", "New volatile double-bit (uncorrectable) ECC errors per GPU "
          "(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL; not in dcgm-exporter's default counters: enable it). " + join,
          [target(dcgm(f'sum by (Hostname, gpu) (increase(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{cluster=~"$cluster"}}[$__rate_interval]))'),
                  "{{Hostname}} GPU {{gpu}}")], 6,
          **series("short", [colour_override(by_regexp("/.*/"), RED)], no_value=NO_DCGM))
    panel("timeseries", "GPU ECC single-bit errors", "New volatile single-bit (corrected) ECC errors per GPU "
          "(DCGM_FI_DEV_ECC_SBE_VOL_TOTAL; enable it in dcgm-exporter's counters). " + join,
          [target(dcgm(f'sum by (Hostname, gpu) (increase(DCGM_FI_DEV_ECC_SBE_VOL_TOTAL{{cluster=~"$cluster"}}[$__rate_interval]))'),
                  "{{Hostname}} GPU {{gpu}}")], 6,
          **series("short", [colour_override(by_regexp("/.*/"), ORANGE)], no_value=NO_DCGM))
    panel("timeseries", "GPU row remapping", "Rows remapped for uncorrectable errors (DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS) "
          "and remapping failures (DCGM_FI_DEV_ROW_REMAP_FAILURE, 1: failed), per GPU. " + join,
          [target(dcgm(f'max by (Hostname, gpu) (DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS{{cluster=~"$cluster"}})'),
                  "{{Hostname}} GPU {{gpu}} uncorrectable rows"),
           target(dcgm(f'max by (Hostname, gpu) (DCGM_FI_DEV_ROW_REMAP_FAILURE{{cluster=~"$cluster"}})'),
                  "{{Hostname}} GPU {{gpu}} remap failure", "B")], 6,
          **series("short", [colour_override(by_regexp("/.*failure/"), RED)], no_value=NO_DCGM))
    panel("table", "XID and ECC per probed GPU",
          "Each probe process's GPU (dsv4_idxk_probe_gpu_info: its CUDA device's UUID, set once at start) beside "
          "DCGM's counters of that very GPU, joined on DCGM's UUID label: the last XID error, and the new "
          "double-bit (uncorrectable) and single-bit ECC errors over the dashboard's range. A corrupt room's "
          "instance and tp_rank lead here: a non-zero XID or ECC count on its GPU says look at the hardware first "
          "(docs/diagnosis.md, 'What to check next').",
          [target(per_probed_gpu(f'max by (UUID, Hostname, gpu) (DCGM_FI_DEV_XID_ERRORS{{cluster=~"$cluster"}})'), "",
                  instant=True, format="table"),
           target(per_probed_gpu(f'sum by (UUID, Hostname, gpu) (increase(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{cluster=~"$cluster"}}[$__range]))'),
                  "", "B", instant=True, format="table"),
           target(per_probed_gpu(f'sum by (UUID, Hostname, gpu) (increase(DCGM_FI_DEV_ECC_SBE_VOL_TOTAL{{cluster=~"$cluster"}}[$__range]))'),
                  "", "C", instant=True, format="table")], 24,
          transformations=[{"id": "merge", "options": {}},
                           {"id": "organize", "options": {"excludeByName": {"Time": True},
                                                          "renameByName": {"Value #A": "last XID", "Value #B": "ECC double-bit",
                                                                           "Value #C": "ECC single-bit"}}}],
          fieldConfig={"defaults": {"noValue": "no GPU identity from the selected probes (CPU, or a probe before "
                                                "gpu_info) or no DCGM series for their GPUs (see docs/observability.md)"},
                       "overrides": [{"matcher": by_regexp("/last XID|ECC double-bit/"), "properties": [
                           {"id": "custom.cellOptions", "value": {"type": "color-background"}},
                           {"id": "thresholds", "value": {"mode": "absolute", "steps": [{"color": GREEN, "value": None},
                                                                                         {"color": RED, "value": 1}]}}]}]})

    row("Probe health")
    panel("timeseries", "Digest GPU time", "GPU time of one digest launch, p50 and p99.",
          [target(quantile(0.5, "digest_gpu_seconds"), "p50 {{stage}}"), target(quantile(0.99, "digest_gpu_seconds"), "p99 {{stage}}", "B")], 8,
          **series("s", no_value="no digests timed in range (timed on CUDA only)"))
    panel("timeseries", "Index-K digested", "Bytes digested per second, by stage.",
          [target(rate("digest_bytes_total", "stage"), "{{stage}}")], 8, **series("Bps"))
    panel("timeseries", "Exchange errors", "Failed side-channel requests for prefill digest vectors.",
          [target(rate("exchange_errors_total", "kind"), "{{kind}}")], 8, **series("ops", [colour_override(by_regexp("/.*/"), RED)]))
    panel("timeseries", "Dropped records", "Records dropped because a bounded queue was full (room log, digest queue).",
          [target(rate("records_dropped_total", "sink"), "{{sink}}")], 8, **series("ops", [colour_override(by_regexp("/.*/"), ORANGE)]))
    panel("timeseries", "Probe errors", "Exceptions caught inside the probe, by the part that raised (serving continued); "
          "the log names the exact site.",
          [target(rate("errors_total", "component"), "{{component}}")], 8, **series("ops"))
    panel("table", "Probe state", "dsv4_idxk_probe_info per process: on, off (uninstalled) or broken (stays off by error: "
          "the log says which file and field), with its mode and version.",
          [target(f"max by (instance, engine_type, model_name, tp_rank, state, reason, mode, version) ({P}info{sel()} == 1)", "",
                  instant=True, format="table")], 8,
          transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True}}}],
          fieldConfig={"defaults": {}, "overrides": [{"matcher": by_name("state"), "properties": [
              {"id": "custom.cellOptions", "value": {"type": "color-background"}},
              {"id": "mappings", "value": [{"type": "value", "options": {"on": {"color": GREEN, "index": 0}, "off": {"color": ORANGE, "index": 1},
                                                                        "broken": {"color": RED, "index": 2}}}]}]}]})
    panel("table", "Patch targets", "Status of each patch target per process (1 = current status); required targets that are not patched are alerted on.",
          [target(f"max by (instance, engine_type, tp_rank, target, status) ({P}patch_target_status{sel()} == 1)", "", instant=True, format="table"),
           target(f"max by (instance, engine_type, tp_rank, target) ({P}patch_target_required{sel()})", "", "B", instant=True, format="table")], 8,
          transformations=[{"id": "merge", "options": {}},
                           {"id": "organize", "options": {"excludeByName": {"Time": True, "Value #A": True}, "renameByName": {"Value #B": "required"}}}],
          fieldConfig={"defaults": {}, "overrides": [{"matcher": by_name("status"), "properties": [
              {"id": "custom.cellOptions", "value": {"type": "color-background"}},
              {"id": "mappings", "value": [{"type": "value", "options": {"patched": {"color": GREEN, "index": 0}, "pending": {"color": ORANGE, "index": 2}}},
                                           {"type": "regex", "options": {"pattern": "missing|signature_changed|hook_error|not_applied", "result": {"color": RED, "index": 1}}}]}]}]})
    panel("table", "Probed hosts", "The host each probe process runs on, as the GPU health row joins it with DCGM's Hostname: "
          "the node label where the scrape adds one, else the host part of instance.",
          [target(f"group by (Hostname, instance, engine_type) ({with_host(P + 'info' + sel())})", "", instant=True, format="table")], 8,
          transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True}}}],
          fieldConfig={"defaults": {}, "overrides": []})
    return out


def variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": f"{name}-values"},
        "refresh": 2,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def link(title: str, tooltip: str, **kw) -> dict:
    return {"title": title, "tooltip": tooltip, "type": "link", "url": "", "tags": [], "icon": "dashboard",
            "asDropdown": False, "includeVars": True, "keepTime": True, "targetBlank": False, **kw}


def dashboard() -> dict:
    any_probe = f"{P}info"  # every probe process publishes it (state on, off or broken)
    labels = {"cluster": "cluster", "namespace": "namespace", "job": "job", "instance": "instance",
              "engine_type": "engine type", "model_name": "model"}
    variables = []
    for i, name in enumerate(VARIABLES):
        before = matchers(VARIABLES[:i])
        selector = any_probe + ("{" + ",".join(before) + "}" if before else "")
        variables.append(variable(name, labels[name], f"label_values({selector}, {name})"))
    return {
        "uid": UID,
        "title": "DeepSeek-V4 index-K probe",
        "description": "Index-K integrity through SGLang PD transfers and HiCache host pools (dsv4-idxk-probe). Generated by dashboards/generate.py.",
        "tags": ["sglang", "deepseek-v4", "dsv4-idxk-probe"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "utc",
        "version": 1,
        "annotations": {"list": []},
        "links": [
            link("SGLang", "SGLang's own dashboard (uid sglang-dashboard, from SGLang's examples/monitoring), same time range "
                 "and instance/model variables", url=f"/d/{SGLANG_DASHBOARD_UID}"),
            link("SGLang dashboards", "Every dashboard tagged sglang", type="dashboards", tags=["sglang"], asDropdown=True),
        ],
        "templating": {
            "list": [
                {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
                 "hide": 0, "refresh": 1, "regex": ""},
                *variables,
            ]
        },
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the checked-in JSON is out of date")
    parser.add_argument("-o", "--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date: run python dashboards/generate.py", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
