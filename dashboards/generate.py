#!/usr/bin/env python3
"""Write the dsv4-idxk-probe Grafana dashboard (dashboards/dsv4-idxk-probe.json).

The JSON is generated, never edited by hand: change this file and run
``python dashboards/generate.py``. ``--check`` exits 1 when the checked-in JSON
differs from what this script writes (the test suite runs the same check),
and the suite also sends every query below to a real Prometheus.
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


def sel(*extra: str) -> str:
    """Label matchers every query carries: the template variables, plus `extra`."""
    return "{" + ",".join(['instance=~"$instance"', 'engine_type=~"$engine_type"', 'model_name=~"$model_name"', *extra]) + "}"


def rate(metric: str, by: str, *extra: str) -> str:
    return f"sum by ({by}) (rate({P}{metric}{sel(*extra)}[$__rate_interval]))"


def increase(metric: str, by: str, *extra: str, window: str = "$__rate_interval") -> str:
    return f"sum by ({by}) (increase({P}{metric}{sel(*extra)}[{window}]))"


def range_total(metric: str, *extra: str) -> str:
    """Events over the dashboard's range, rounded up so one event never shows as 0.4."""
    return f"ceil(sum(increase({P}{metric}{sel(*extra)}[$__range])))"


def quantile(q: float, metric: str) -> str:
    return f"histogram_quantile({q}, sum by (le, stage) (rate({P}{metric}_bucket{sel()}[$__rate_interval])))"


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

    def series(unit: str = "short", overrides: list | None = None, stack: bool = False) -> dict:
        custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
        if stack:
            custom["stacking"] = {"mode": "normal"}
        return {"fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": overrides or []},
                "options": {"legend": {"displayMode": "table", "placement": "right", "calcs": ["sum"]}, "tooltip": {"mode": "multi"}}}

    def thresholds(*steps: tuple) -> dict:
        return {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in steps]}

    def heat(label: str, metric: str, what: str) -> None:
        panel(
            "heatmap",
            f"Localisation heat: {what}",
            f"Mismatches per {what} over time (counter {P}{metric}). Page heat is by power-of-two page "
            "bucket (labels never carry a page); exact (layer, page) cells are in `dsv4-idxk-probe report`.",
            [target(increase(metric, label), f"{{{{{label}}}}}", format="time_series")],
            12,
            options={"calculate": False, "yAxis": {"axisLabel": what}, "rowsFrame": {"layout": "auto"},
                     "color": {"mode": "scheme", "scheme": "Reds", "exponent": 0.5}, "cellGap": 1,
                     "tooltip": {"show": True, "yHistogram": False}},
        )

    row("Verification (prefill -> decode)")
    panel("stat", "Mismatching rooms", "Rooms whose decode digest differed from prefill's, over the dashboard range. Red above zero.",
          [target(range_total("rooms_verified_total", 'verdict="mismatch"'), "mismatches")],
          6, 5, fieldConfig={"defaults": {"unit": "short", "thresholds": thresholds((GREEN, None), (RED, 1)), "color": {"mode": "thresholds"}}, "overrides": []},
          options={"colorMode": "background", "graphMode": "none", "reduceOptions": {"calcs": ["lastNotNull"]}})
    panel("stat", "Verified room-stages", "Decode-stage verdicts of any kind over the dashboard range.",
          [target(range_total("rooms_verified_total"), "verdicts")],
          6, 5, options={"colorMode": "none", "graphMode": "area", "reduceOptions": {"calcs": ["lastNotNull"]}})
    panel("stat", "Unverified or not comparable", "Room-stages with no prefill digest in time, or with a different layout signature, over the range.",
          [target(range_total("rooms_verified_total", 'verdict=~"unverified|not_comparable"'), "rooms")],
          6, 5, fieldConfig={"defaults": {"unit": "short", "thresholds": thresholds((GREEN, None), (ORANGE, 1)), "color": {"mode": "thresholds"}}, "overrides": []},
          options={"colorMode": "background", "graphMode": "none", "reduceOptions": {"calcs": ["lastNotNull"]}})
    panel("stat", "Rooms digested on prefill", "Rooms whose index-K prefill digested as it left, over the range.",
          [target(range_total("rooms_digested_total", 'stage="prefill_send"'), "rooms")],
          6, 5, options={"colorMode": "none", "graphMode": "area", "reduceOptions": {"calcs": ["lastNotNull"]}})
    panel("timeseries", "Verified rooms by stage and verdict", "Decode-stage verdicts per second.",
          [target(rate("rooms_verified_total", "stage, verdict"), "{{stage}} {{verdict}}")], 12,
          **series("ops", [colour_override(by_regexp("/.* mismatch/"), RED), colour_override(by_regexp("/.* not_comparable/"), ORANGE),
                           colour_override(by_regexp("/.* unverified/"), GREY)], stack=True))
    panel("bargauge", "First-divergence stage", "Mismatching rooms by the earliest decode stage whose digest differed "
          "(decode_recv: corrupt in transfer; decode_step/finish: corrupted after receipt).",
          [target(increase("first_divergence_total", "stage", window="$__range"), "{{stage}}", instant=True)], 6,
          options={"orientation": "horizontal", "displayMode": "basic", "reduceOptions": {"calcs": ["lastNotNull"]}},
          fieldConfig={"defaults": {"color": {"mode": "fixed", "fixedColor": RED}, "unit": "short"}, "overrides": []})
    panel("timeseries", "Mismatching cells by segment", "Differing (layer, page) cells per second, by row segment (payload, scale, ...).",
          [target(rate("mismatch_cells_total", "stage, segment"), "{{stage}} {{segment}}")], 6, **series("ops"))
    heat("layer", "mismatch_layer_hits_total", "layer")
    heat("page_bucket", "mismatch_page_bucket_hits_total", "page bucket")
    panel("timeseries", "Unverified and not-comparable rooms", "Unverified: no prefill digest in time. Not comparable: layout signatures differ (a rolling upgrade, not corruption).",
          [target(rate("rooms_verified_total", "stage, verdict", 'verdict=~"unverified|not_comparable"'), "{{stage}} {{verdict}}")], 12,
          **series("ops", [colour_override(by_regexp("/.* not_comparable/"), ORANGE)]))
    panel("timeseries", "Verify latency p99", "From a decode digest's enqueue to its verdict.",
          [target(quantile(0.99, "verify_latency_seconds"), "p99 {{stage}}")], 12, **series("s"))

    row("HiCache host pools")
    panel("timeseries", "HiCache branch hits per pool", "Host-pool copy calls by branch. Red: the token-granular path on an indexer pool, "
          "which applies the C4 row geometry to rows that are not C4 rows.",
          [target(rate("hicache_copies_total", "pool, direction, branch"), "{{pool}} {{direction}} {{branch}}")], 12,
          **series("ops", [colour_override(by_regexp(TOKEN_PATH_ON_INDEXER), RED)]))
    panel("timeseries", "Guard and index-check violations", "Token-path guard hits, index groups that are not whole aligned in-range pages, failed pool invariants.",
          [target(increase("hicache_guard_total", "pool, action"), "guard {{pool}} {{action}}"),
           target(increase("hicache_index_violations_total", "pool, direction, check"), "index {{pool}} {{direction}} {{check}}", "B"),
           target(increase("hicache_invariant_violations_total", "pool, invariant"), "invariant {{pool}} {{invariant}}", "C")], 12,
          **series("short", [colour_override(by_regexp("/.*/"), RED)]))
    panel("timeseries", "HiCache round-trip checks", "Opt-in round-trip digests of host-pool rows, by leg and verdict.",
          [target(rate("hicache_roundtrip_total", "pool, leg, verdict"), "{{pool}} {{leg}} {{verdict}}")], 12,
          **series("ops", [colour_override(by_regexp("/.* mismatch/"), RED)]))
    panel("timeseries", "HiCache pages moved", "Pages moved by host-pool copies, per pool and direction.",
          [target(rate("hicache_pages_total", "pool, direction"), "{{pool}} {{direction}}")], 12, **series("ops"))

    row("Probe health")
    panel("timeseries", "Digest GPU time", "GPU time of one digest launch, p50 and p99.",
          [target(quantile(0.5, "digest_gpu_seconds"), "p50 {{stage}}"), target(quantile(0.99, "digest_gpu_seconds"), "p99 {{stage}}", "B")], 8, **series("s"))
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
    return out


def variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "refresh": 2,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def dashboard() -> dict:
    any_probe = f"{P}info"  # every probe process publishes it (state on, off or broken)
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
        "links": [],
        "templating": {
            "list": [
                {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
                 "current": {}, "hide": 0, "refresh": 1, "regex": ""},
                variable("instance", "instance", f"label_values({any_probe}, instance)"),
                variable("engine_type", "engine type", f'label_values({any_probe}{{instance=~"$instance"}}, engine_type)'),
                variable("model_name", "model", f'label_values({any_probe}{{instance=~"$instance",engine_type=~"$engine_type"}}, model_name)'),
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
