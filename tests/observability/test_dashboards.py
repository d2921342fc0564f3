"""The dashboard is generated, current, and queries only metrics the probe defines."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess

import pytest
import yaml
from prometheus_client import CollectorRegistry
from promql import ALERT_TESTS, ALERTS, DASHBOARD, REPO, alert_rules, load_dashboard, metric_names, panel_queries, variable_queries

from dsv4_idxk_probe.metrics.definitions import ProbeMetrics

REQUIRED_PANELS = [
    "Verified rooms by stage and verdict", "Mismatching rooms", "First-divergence stage", "Localisation heat: layer",
    "Localisation heat: page bucket", "Unverified and not-comparable rooms", "HiCache branch hits per pool",
    "Guard and index-check violations", "Digest GPU time", "Exchange errors", "Dropped records", "Probe errors",
    "Probe state", "Patch targets",
]
VARIABLES = ["datasource", "instance", "engine_type", "model_name"]


def generator():
    spec = importlib.util.spec_from_file_location("generate_dashboard", REPO / "dashboards" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exported_series_names() -> set[str]:
    registry = CollectorRegistry()
    ProbeMetrics(registry, role="decode")
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
    assert [v["name"] for v in dash["templating"]["list"]] == VARIABLES
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
        for variable in ("$instance", "$engine_type", "$model_name"):
            assert variable in expr, f"{where} ignores {variable}"
    for rule in alert_rules():
        names = metric_names(rule["expr"])
        assert names and names <= defined, f"{rule['alert']}: {names - defined}"
        assert not re.search(r"\b(role|model|rank)\b(?!_)", rule["expr"]), f"{rule['alert']} uses a label the probe no longer has"
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


def test_alert_rules_cover_the_six_conditions():
    names = {r["alert"] for r in alert_rules()}
    assert names == {"Dsv4IdxkProbeIndexKMismatch", "Dsv4IdxkProbeTokenPathOnNonC4Pool",
                     "Dsv4IdxkProbeRequiredPatchTargetMissing", "Dsv4IdxkProbeRecordsDropped",
                     "Dsv4IdxkProbeOffByError", "Dsv4IdxkProbeMetricsAbsent"}


def test_dashboard_schema_datasources_and_variables():
    """What Grafana would resolve on import: every datasource reference is the
    dashboard's own variable, every $variable a query uses is defined, every
    query variable reads the probe's info metric and names its own label."""
    dash = load_dashboard()
    variables = dash["templating"]["list"]
    defined = {v["name"] for v in variables}
    (ds,) = [v for v in variables if v["type"] == "datasource"]
    assert ds["name"] == "datasource" and ds["query"] == "prometheus"
    reference = {"type": "prometheus", "uid": "${datasource}"}
    builtins = {"__rate_interval", "__range", "__interval"}
    for panel in dash["panels"]:
        assert isinstance(panel["id"], int) and panel["type"] in {"row", "stat", "timeseries", "bargauge", "heatmap", "table"}
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == reference, panel["title"]
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            assert t["datasource"] == reference, panel["title"]
            used = set(re.findall(r"\$\{?(\w+)", t["expr"]))
            assert used <= defined | builtins, f"{panel['title']}: undefined {used - defined - builtins}"
    for v in variables:
        if v["type"] != "query":
            continue
        assert v["datasource"] == reference, v["name"]
        assert v["query"]["query"] == v["definition"]
        assert v["query"]["query"].startswith("label_values(dsv4_idxk_probe_info"), v["name"]
        assert v["query"]["query"].rstrip(")").endswith(f", {v['name']}"), v["name"]
        used = set(re.findall(r"\$(\w+)", v["query"]["query"]))
        earlier = [w["name"] for w in variables[: variables.index(v)]]
        assert used <= set(earlier), f"{v['name']} depends on a later variable"


def test_schema_check_catches_a_broken_reference(monkeypatch):
    dash = load_dashboard()
    dash["panels"][1]["targets"][0]["datasource"] = {"type": "prometheus", "uid": "P1234"}
    monkeypatch.setitem(globals(), "load_dashboard", lambda: dash)
    with pytest.raises(AssertionError):
        test_dashboard_schema_datasources_and_variables()


def test_alert_unit_tests_pass_promtool_and_cover_every_rule():
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    fired = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"] if t["exp_alerts"]}
    quiet = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"] if not t["exp_alerts"]}
    names = {r["alert"] for r in alert_rules()}
    assert fired == names, f"rules without a firing case: {names - fired}"
    assert {"Dsv4IdxkProbeIndexKMismatch", "Dsv4IdxkProbeMetricsAbsent", "Dsv4IdxkProbeRecordsDropped"} <= quiet
    proc = subprocess.run([tool("promtool"), "test", "rules", ALERT_TESTS.name], capture_output=True, text=True,
                          timeout=60, cwd=ALERT_TESTS.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_mismatch_alert_per_stage_fails_the_unit_tests(tmp_path):
    """The per-room case can fail: counting stage verdicts fires once per stage that saw the room."""
    per_stage = ALERTS.read_text().replace(
        "increase(dsv4_idxk_probe_first_divergence_total[10m])",
        'increase(dsv4_idxk_probe_rooms_verified_total{verdict="mismatch"}[10m])')
    assert per_stage != ALERTS.read_text()
    (tmp_path / "alerts.yml").write_text(per_stage)
    (tmp_path / "alerts.test.yml").write_text(ALERT_TESTS.read_text())
    proc = subprocess.run([tool("promtool"), "test", "rules", "alerts.test.yml"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode != 0 and "Dsv4IdxkProbeIndexKMismatch" in proc.stdout + proc.stderr


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
