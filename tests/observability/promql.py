"""Every PromQL expression the dashboard and the alert rules send, ready for a real Prometheus."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "dashboards" / "dsv4-idxk-probe.json"
ALERTS = REPO / "configs" / "prometheus" / "alerts.yml"
ALERT_TESTS = REPO / "configs" / "prometheus" / "alerts.test.yml"

# What Grafana would put in: "All" for the template variables, short windows for a short test.
GRAFANA_VARIABLES = {
    "$__rate_interval": "30s",
    "$__range": "5m",
    "$instance": ".*",
    "$engine_type": ".*",
    "$model_name": ".*",
}
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.*),\s*(?P<label>\w+)\)$")


def substitute(expr: str) -> str:
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


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


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bdsv4_idxk_probe_[a-z0-9_]+", expr))


def dashboard_gaps(prom, skip: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """Ask a live Prometheus (`prom.series`, `prom.query`) every dashboard variable and panel
    query: (what returned nothing, the panel queries asked). Panels whose title starts with
    one of `skip` are not asked."""
    missing, checked = [], []
    dashboard = load_dashboard()
    for name, selector, label in variable_queries(dashboard):
        found = prom.series(substitute(selector))
        if not found or not all(s["metric"].get(label) for s in found):
            missing.append(f"variable {name}: no {label} values from {selector}")
    for where, expr in panel_queries(dashboard):
        if skip and where.startswith(skip):
            continue
        checked.append(where)
        answer = prom.query(substitute(expr))
        if answer.get("status") != "success" or not answer["data"]["result"]:
            missing.append(f"{where}: no series for {substitute(expr)}")
    return missing, checked
