"""The dashboard is generated, current, and queries only metrics the probe defines."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess

import pytest
import yaml
from prometheus_client import CollectorRegistry
from promql import ALERTS, DASHBOARD, REPO, alert_rules, load_dashboard, metric_names, panel_queries, variable_queries

from dsv4_idxk_probe.metrics.definitions import ProbeMetrics

REQUIRED_PANELS = [
    "Verified rooms by stage and verdict", "Mismatching rooms", "First-divergence stage", "Localisation heat: layer",
    "Localisation heat: page bucket", "Unverified and not-comparable rooms", "HiCache branch hits per pool",
    "Guard and index-check violations", "Digest GPU time", "Exchange errors", "Dropped records", "Patch targets",
]


def generator():
    spec = importlib.util.spec_from_file_location("generate_dashboard", REPO / "dashboards" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exported_series_names() -> set[str]:
    registry = CollectorRegistry()
    ProbeMetrics(registry)
    names = set()
    for family in registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name)
    return names


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: run .ci/install-test-services.sh (make test does)")
    return path


def test_checked_in_json_is_what_the_generator_writes():
    assert DASHBOARD.read_text() == generator().render(), "run: python dashboards/generate.py"


def test_generator_check_mode_catches_a_stale_file(tmp_path):
    stale = tmp_path / "d.json"
    stale.write_text(DASHBOARD.read_text().replace("Dropped records", "Dropped"))
    assert generator().main(["--check", "-o", str(stale)]) == 1
    stale.write_text(DASHBOARD.read_text())
    assert generator().main(["--check", "-o", str(stale)]) == 0


def test_identity_variables_and_panels():
    dash = load_dashboard()
    assert dash["uid"] == "dsv4-idxk-probe"
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource", "instance", "role", "model"]
    titles = [p["title"] for p in dash["panels"]]
    assert [t for t in REQUIRED_PANELS if t not in titles] == []
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]


def test_every_query_names_a_defined_metric_and_filters_by_the_variables():
    defined = exported_series_names()
    for where, expr in panel_queries(load_dashboard()):
        names = metric_names(expr)
        assert names and names <= defined, f"{where}: {names - defined}"
        for variable in ("$instance", "$role", "$model"):
            assert variable in expr, f"{where} ignores {variable}"
    for rule in alert_rules():
        names = metric_names(rule["expr"])
        assert names and names <= defined, f"{rule['alert']}: {names - defined}"
    for name, selector, _ in variable_queries(load_dashboard()):
        assert metric_names(selector) <= defined, name


def test_stat_for_mismatches_turns_red_above_zero():
    panel = next(p for p in load_dashboard()["panels"] if p["title"] == "Mismatching rooms")
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[0]["color"] == "green" and steps[1] == {"color": "red", "value": 1}
    assert panel["targets"][0]["expr"].startswith("ceil(")  # 0.4 of an event must still count as one


def test_token_path_on_an_indexer_pool_is_drawn_red():
    panel = next(p for p in load_dashboard()["panels"] if p["title"] == "HiCache branch hits per pool")
    override = panel["fieldConfig"]["overrides"][0]
    assert override["properties"][0]["value"]["fixedColor"] == "red"
    pattern = re.compile(override["matcher"]["options"].strip("/"))
    legend = panel["targets"][0]["legendFormat"]
    name = lambda pool, branch: legend.replace("{{pool}}", pool).replace("{{direction}}", "h2d").replace("{{branch}}", branch)
    assert pattern.fullmatch(name("deepseek_v4_c4_indexer", "token_dsv4_mla"))
    assert not pattern.fullmatch(name("deepseek_v4_c4_indexer", "page"))
    assert not pattern.fullmatch(name("dsv4_hisparse_c4", "token_dsv4_mla"))


def test_alert_rules_pass_promtool():
    proc = subprocess.run([tool("promtool"), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in proc.stdout


def test_alert_rules_cover_the_four_conditions():
    names = {r["alert"] for r in alert_rules()}
    assert names == {"Dsv4IdxkProbeIndexKMismatch", "Dsv4IdxkProbeTokenPathOnNonC4Pool",
                     "Dsv4IdxkProbeRequiredPatchTargetMissing", "Dsv4IdxkProbeRecordsDropped"}


def test_example_prometheus_config_passes_promtool():
    config = REPO / "configs" / "prometheus" / "prometheus.yml"
    proc = subprocess.run([tool("promtool"), "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_grafana_provisioning_points_at_a_file_provider_and_a_prometheus():
    providers = yaml.safe_load((REPO / "configs" / "grafana" / "dashboards.yaml").read_text())
    (provider,) = providers["providers"]
    assert providers["apiVersion"] == 1 and provider["type"] == "file" and provider["options"]["path"]
    sources = yaml.safe_load((REPO / "configs" / "grafana" / "datasources.yaml").read_text())
    assert [s["type"] for s in sources["datasources"]] == ["prometheus"]
    (datasource_var,) = [v for v in load_dashboard()["templating"]["list"] if v["type"] == "datasource"]
    assert datasource_var["query"] == "prometheus"
