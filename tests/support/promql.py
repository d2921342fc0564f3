"""Every PromQL expression the dashboard, the alert rules and docs/observability.md send,
ready for a real Prometheus."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "dashboards" / "dsv4-idxk-probe.json"
ALERTS = REPO / "configs" / "prometheus" / "alerts.yml"
ALERT_TESTS = REPO / "configs" / "prometheus" / "alerts.test.yml"
OBSERVABILITY_DOC = REPO / "docs" / "observability.md"

# What Grafana would put in: "All" for the template variables, short windows for a short test.
GRAFANA_VARIABLES = {
    "$__rate_interval": "30s",
    "$__range": "5m",
    "$cluster": ".*",
    "$namespace": ".*",
    "$job": ".*",
    "$instance": ".*",
    "$engine_type": ".*",
    "$model_name": ".*",
}
# Variables whose label only some scrapes add (kube-prometheus, multi-cluster setups):
# they may have no values; their "All" (.*) then matches the missing label.
OPTIONAL_VARIABLES = ("cluster", "namespace")
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.*),\s*(?P<label>\w+)\)$")
# What a dashboard query appends when an empty answer means zero (dashboards/generate.py, ZERO).
FALLBACK = re.compile(r"\s+or\s+vector\(0\)\s*$")
SGLANG_NAME = re.compile(r"sglang\[:_\]([a-z0-9_]+)")
DCGM_NAME = re.compile(r"\bDCGM_FI_[A-Z0-9_]+")


def substitute(expr: str, **values: str) -> str:
    """`expr` with Grafana's variables filled in: "All" (or `values`, by variable name)."""
    table = {**GRAFANA_VARIABLES, **{f"${name}": value for name, value in values.items()}}
    for name in sorted(table, key=len, reverse=True):
        expr = expr.replace(name, table[name])
    assert not re.search(r"\$[A-Za-z_{]", expr), f"unsubstituted variable in {expr}"  # $1 is label_replace's
    return expr


def strip_fallback(expr: str) -> str:
    """`expr` without its trailing `or vector(0)`: what must return data on its own."""
    return FALLBACK.sub("", expr)


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title / refId, expr) for every query of every panel."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((f"{panel['title']} / {target['refId']}", target["expr"]))
    return out


def variable_queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(variable, selector, label) for every label_values() template variable."""
    out = []
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        match = LABEL_VALUES.match(var["query"]["query"])
        assert match, f"variable {var['name']}: unexpected query {var['query']['query']}"
        out.append((var["name"], match["selector"], match["label"]))
    return out


def alert_rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def doc_queries(path: Path = OBSERVABILITY_DOC) -> list[str]:
    """The ```promql blocks of a document (each one expression; `#` lines are comments)."""
    blocks = re.findall(r"^```promql\n(.*?)^```", path.read_text(), flags=re.M | re.S)
    return ["\n".join(line for line in block.splitlines() if not line.lstrip().startswith("#")).strip() for block in blocks]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bdsv4_idxk_probe_[a-z0-9_]+", expr))


def sglang_names(expr: str) -> set[str]:
    """SGLang's metrics an expression reads, by SGLang's own name ("sglang:<name>"); it must
    match them as `{__name__=~"sglang[:_]<name>"}`, both spellings Prometheus may store."""
    return {f"sglang:{name}" for name in SGLANG_NAME.findall(expr)}


def dcgm_names(expr: str) -> set[str]:
    return set(DCGM_NAME.findall(expr))


def is_external(expr: str) -> bool:
    """Whether a query reads series the probe does not export (SGLang's, DCGM's)."""
    return bool(sglang_names(expr) or dcgm_names(expr))


def dashboard_gaps(prom, skip: tuple[str, ...] = (), external: bool = False) -> tuple[list[str], list[str]]:
    """Ask a live Prometheus (`prom.series`, `prom.query`) every dashboard variable and panel
    query: (what returned nothing, the panel queries asked). Panels whose title starts with
    one of `skip` are not asked, nor, unless `external`, queries of SGLang's or DCGM's
    series. A query's `or vector(0)` is left out: the query itself must return data.
    OPTIONAL_VARIABLES may have no values."""
    missing, checked = [], []
    dashboard = load_dashboard()
    for name, selector, label in variable_queries(dashboard):
        if name in OPTIONAL_VARIABLES:
            continue
        found = prom.series(substitute(selector))
        if not found or not all(s["metric"].get(label) for s in found):
            missing.append(f"variable {name}: no {label} values from {selector}")
    for where, expr in panel_queries(dashboard):
        if (skip and where.startswith(skip)) or (is_external(expr) and not external):
            continue
        checked.append(where)
        query = substitute(strip_fallback(expr))
        answer = prom.query(query)
        if answer.get("status") != "success" or not answer["data"]["result"]:
            missing.append(f"{where}: no series for {query}")
    return missing, checked
