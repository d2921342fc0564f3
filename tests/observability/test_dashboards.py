"""The dashboard is generated, current, and queries only metrics the probe, SGLang and DCGM
define; the alert rules pass promtool, their unit tests cover every rule both ways, and
every rule links a runbook."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from dsv4_idxk_probe.metrics.definitions import ProbeMetrics

from tests.support.promql import (ALERT_TESTS, ALERTS, DASHBOARD, REPO, alert_rules, dcgm_names, is_external, load_dashboard,
                                  metric_names, panel_queries, sglang_names, strip_fallback, variable_queries)

REQUIRED_PANELS = [
    "Verified rooms by stage and verdict", "Mismatching rooms", "Mismatch ratio", "First-divergence stage",
    "Localisation heat: layer", "Localisation heat: page bucket", "Unverified and not-comparable rooms",
    "Decode requests and verified rooms", "Verification coverage", "KV transfer and bootstrap failures",
    "KV transfer latency p99", "PD queues", "HiCache pools", "HiCache branch hits per pool",
    "Guard and index-check violations", "GPU XID errors", "GPU ECC double-bit errors", "GPU ECC single-bit errors",
    "GPU row remapping", "Digest GPU time", "Exchange errors", "Dropped records", "Probe errors", "Probe state",
    "Patch targets", "Probed hosts",
]
VARIABLES = ["datasource", "cluster", "namespace", "job", "instance", "engine_type", "model_name"]
ALERTS_SHIPPED = {
    "Dsv4IdxkProbeIndexKMismatch", "Dsv4IdxkProbeTokenPathOnNonC4Pool", "Dsv4IdxkProbeRequiredPatchTargetMissing",
    "Dsv4IdxkProbeRecordsDropped", "Dsv4IdxkProbeOffByError", "Dsv4IdxkProbeMetricsAbsent", "Dsv4IdxkProbeErrors",
    "Dsv4IdxkProbeExchangeErrors", "Dsv4IdxkProbeUnverifiedRatioHigh", "Dsv4IdxkProbeDecodeVerifiesNone",
    "Dsv4IdxkProbeCoverageLow", "Dsv4IdxkProbeMismatchUnlocalised",
    "Dsv4IdxkProbeHiCacheRestoreMismatch", "Dsv4IdxkProbeSideInactive",
}
# dcgm-exporter's fields the GPU row reads (its etc/default-counters.csv; the ECC ones are
# commented out there by default).
DCGM_FIELDS = {"DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
               "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_FAILURE"}
RUNBOOKS = REPO / "docs" / "runbooks"


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


def sglang_defined_names() -> set[str]:
    """Every metric name the installed SGLang registers ("sglang:..."), read from its source
    (importing SGLang is slow and needs its runtime), with the series names histograms add."""
    spec = importlib.util.find_spec("sglang")
    assert spec and spec.origin, "SGLang is not installed (make test installs it)"
    observability = Path(spec.origin).parent / "srt" / "observability"
    names = set()
    for source in observability.glob("*.py"):
        names |= set(re.findall(r'name="(sglang:[a-z0-9_]+)"', source.read_text(encoding="utf-8")))
    assert "sglang:context_len" in names, f"no SGLang metric names found under {observability}"
    return names | {name + suffix for name in names for suffix in ("_bucket", "_sum", "_count")}


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: run .ci/install-test-services.sh (make test does)")
    return path


def panels_by_title() -> dict[str, dict]:
    return {p["title"]: p for p in load_dashboard()["panels"]}


def rows() -> dict[str, list[dict]]:
    """Row title -> the panels below it."""
    out: dict[str, list[dict]] = {}
    current = None
    for panel in load_dashboard()["panels"]:
        if panel["type"] == "row":
            current = out.setdefault(panel["title"], [])
        elif current is not None:
            current.append(panel)
    return out


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
    defined, sglang, dcgm_used = exported_series_names(), sglang_defined_names(), set()
    for where, expr in panel_queries(load_dashboard()):
        names = metric_names(expr)
        assert names <= defined, f"{where}: {names - defined}"
        assert names or is_external(expr), f"{where} reads no metric"
        assert sglang_names(expr) <= sglang, f"{where}: not SGLang's: {sglang_names(expr) - sglang}"
        assert not re.search(r"\bsglang[:_][a-z]", expr.replace("sglang[:_]", "")), \
            f"{where} names one spelling of an SGLang metric; match both: {{__name__=~\"sglang[:_]...\"}}"
        dcgm_used |= dcgm_names(expr)
        for variable in ("$cluster", "$instance", "$engine_type", "$model_name"):
            assert variable in expr, f"{where} ignores {variable}"
        if not dcgm_names(expr):  # DCGM's exporters are not in the probe's namespace or job
            assert "$namespace" in expr and "$job" in expr, where
    assert dcgm_used <= DCGM_FIELDS and "DCGM_FI_DEV_XID_ERRORS" in dcgm_used and "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL" in dcgm_used
    for rule in alert_rules():
        names = metric_names(rule["expr"])
        assert names and names <= defined, f"{rule['alert']}: {names - defined}"
        assert sglang_names(rule["expr"]) <= sglang, rule["alert"]
        assert not re.search(r"\b(role|model|rank)\b(?!_)", rule["expr"]), f"{rule['alert']} uses a label the probe no longer has"
    for name, selector, _ in variable_queries(load_dashboard()):
        assert metric_names(selector) <= defined, name


def test_mismatching_rooms_counts_rooms_once_as_whole_numbers():
    """The stat read 73 for 11 corrupt rooms: it summed the stage verdicts (a room mismatching at
    decode_step and decode_finish on 8 ranks counts 16). It counts first divergences, as the
    alert does, floored so that extrapolation never shows 11.3 or rounds 11 up to 12."""
    panel = panels_by_title()["Mismatching rooms"]
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[0]["color"] == "green" and steps[1] == {"color": "red", "value": 1}
    expr = panel["targets"][0]["expr"]
    assert metric_names(expr) == {"dsv4_idxk_probe_first_divergence_total"}, expr
    assert "floor(increase(" in expr and "ceil(" not in expr, expr


def test_mismatch_ratio_is_mismatching_rooms_over_verified_rooms():
    expr = panels_by_title()["Mismatch ratio"]["targets"][0]["expr"]
    numerator, denominator = strip_fallback(expr).split(" / ", 1)
    assert metric_names(numerator) == {"dsv4_idxk_probe_first_divergence_total"}
    assert metric_names(denominator) == {"dsv4_idxk_probe_rooms_verified_total"}
    assert 'stage="decode_recv"' in denominator and 'verdict=~"match|mismatch"' in denominator
    assert panels_by_title()["Mismatch ratio"]["fieldConfig"]["defaults"]["unit"] == "percentunit"


def test_no_panel_of_the_hicache_row_says_no_data_without_hicache():
    """A cluster without HiCache has no host-pool series: each panel says so, or shows 0."""
    (hicache,) = [panels for title, panels in rows().items() if title.startswith("HiCache")]
    assert hicache
    for panel in hicache:
        no_value = panel.get("fieldConfig", {}).get("defaults", {}).get("noValue")
        zero = all(strip_fallback(t["expr"]) != t["expr"] for t in panel["targets"])
        assert no_value or zero, f"{panel['title']} shows 'No data' without HiCache"
    pools = panels_by_title()["HiCache pools"]
    assert pools["targets"][0]["expr"].endswith(" or vector(0)")


def test_links_to_sglangs_dashboard():
    links = load_dashboard()["links"]
    by_url = {link.get("url"): link for link in links}
    sglang = by_url["/d/sglang-dashboard"]  # the uid of SGLang's examples/monitoring dashboard
    assert sglang["includeVars"] and sglang["keepTime"]
    assert any(link["type"] == "dashboards" and "sglang" in link["tags"] for link in links)


def test_cluster_namespace_and_job_variables_work_without_their_labels():
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    for name in ("cluster", "namespace", "job"):
        var = variables[name]
        # "All" must be .*, which also matches a series without the label; never Grafana's
        # own "All" (a regex of the listed values), which would match nothing when none exist.
        assert var["includeAll"] and var["allValue"] == ".*", name


def test_sglang_pd_panels_read_sglangs_own_metrics():
    (pd,) = [panels for title, panels in rows().items() if title.startswith("SGLang PD")]
    names = set().union(*(sglang_names(t["expr"]) for p in pd for t in p["targets"]))
    assert {"sglang:num_requests_total", "sglang:num_transfer_failed_reqs_total", "sglang:num_bootstrap_failed_reqs_total",
            "sglang:kv_transfer_latency_ms_bucket", "sglang:num_decode_transfer_queue_reqs"} <= names, names
    assert names <= sglang_defined_names()


def test_gpu_row_joins_dcgm_by_host():
    (gpu,) = [panels for title, panels in rows().items() if title.startswith("GPU health")]
    for panel in gpu:
        assert panel["fieldConfig"]["defaults"]["noValue"], panel["title"]
        for t in panel["targets"]:
            assert dcgm_names(t["expr"]), panel["title"]
            if "dsv4_idxk_probe_gpu_info" in t["expr"]:  # per GPU: test_gpu_row_joins_dcgm_per_gpu_uuid
                continue
            assert "* on (Hostname) group_left" in t["expr"] and "dsv4_idxk_probe_info" in t["expr"], panel["title"]
            assert '"node"' in t["expr"] and '"instance"' in t["expr"], panel["title"]


def test_gpu_row_joins_dcgm_per_gpu_uuid():
    """Each probe process beside its own GPU's XID and ECC counters: DCGM's UUID label joined with
    dsv4_idxk_probe_gpu_info's gpu_uuid (the live Prometheus test checks the rows)."""
    (gpu,) = [panels for title, panels in rows().items() if title.startswith("GPU health")]
    per_gpu = [p for p in gpu if any("dsv4_idxk_probe_gpu_info" in t["expr"] for t in p["targets"])]
    assert per_gpu, "no panel joins DCGM per GPU"
    fields = set()
    for panel in per_gpu:
        for t in panel["targets"]:
            assert '"UUID", "$1", "gpu_uuid"' in t["expr"] and "* on (UUID) group_left" in t["expr"], panel["title"]
            fields |= dcgm_names(t["expr"])
    assert {"DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"} <= fields


def test_token_path_on_an_indexer_pool_is_drawn_red():
    panel = panels_by_title()["HiCache branch hits per pool"]
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


def test_alert_rules_cover_the_conditions():
    assert {r["alert"] for r in alert_rules()} == ALERTS_SHIPPED


def test_every_alert_links_its_runbook():
    for rule in alert_rules():
        url = rule["annotations"].get("runbook_url", "")
        assert url.startswith("https://") and url.endswith(f"/{rule['alert']}.md"), f"{rule['alert']}: {url!r}"
        page = RUNBOOKS / f"{rule['alert']}.md"
        assert page.is_file(), f"{rule['alert']}: no {page.relative_to(REPO)}"
        text = page.read_text()
        assert text.startswith(f"# {rule['alert']} ({rule['labels']['severity']})"), page.name
        for section in ("## What it means", "## What to check next", "## How to silence"):
            assert section in text, f"{page.name}: no {section!r}"
    mismatch = (RUNBOOKS / "Dsv4IdxkProbeIndexKMismatch.md").read_text()
    for what in ("transfer engine", "XID", "ECC", "DCGM", "--hicache-io-backend", "amtool silence"):
        assert what in mismatch or what in (RUNBOOKS / "README.md").read_text(), what
    assert {p.stem for p in RUNBOOKS.glob("Dsv4*.md")} == ALERTS_SHIPPED, "a runbook without its alert"


def test_dashboard_schema_datasources_and_variables():
    """What Grafana would resolve on import: every datasource reference is the
    dashboard's own variable, every $variable a query uses is defined, every
    query variable reads the probe's info metric and names its own label.
    (Grafana's own schema is checked by test_grafana_schema.py.)"""
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
            used = set(re.findall(r"\$\{?([A-Za-z_]\w*)", t["expr"]))  # $1 is label_replace's own
            assert used <= defined | builtins, f"{panel['title']}: undefined {used - defined - builtins}"
    for v in variables:
        if v["type"] != "query":
            continue
        assert v["datasource"] == reference, v["name"]
        assert v["query"]["query"].startswith("label_values(dsv4_idxk_probe_info"), v["name"]
        assert v["query"]["query"].rstrip(")").endswith(f", {v['name']}"), v["name"]
        used = set(re.findall(r"\$(\w+)", v["query"]["query"]))
        earlier = [w["name"] for w in variables[: variables.index(v)]]
        assert used <= set(earlier), f"{v['name']} depends on a later variable"
        assert set(earlier) - {"datasource"} <= used, f"{v['name']} ignores an earlier variable"


def test_schema_check_catches_a_broken_reference(monkeypatch):
    dash = load_dashboard()
    dash["panels"][1]["targets"][0]["datasource"] = {"type": "prometheus", "uid": "P1234"}
    monkeypatch.setitem(globals(), "load_dashboard", lambda: dash)
    with pytest.raises(AssertionError):
        test_dashboard_schema_datasources_and_variables()


def test_alert_unit_tests_pass_promtool_and_cover_every_rule_both_ways():
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    fired = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"] if t["exp_alerts"]}
    quiet = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"] if not t["exp_alerts"]}
    names = {r["alert"] for r in alert_rules()}
    assert fired == names, f"rules without a firing case: {names - fired}"
    assert quiet == names, f"rules without a quiet case: {names - quiet}"
    proc = subprocess.run([tool("promtool"), "test", "rules", ALERT_TESTS.name], capture_output=True, text=True,
                          timeout=60, cwd=ALERT_TESTS.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def promtool_tests_with(tmp_path, rules: str) -> subprocess.CompletedProcess:
    (tmp_path / "alerts.yml").write_text(rules)
    (tmp_path / "alerts.test.yml").write_text(ALERT_TESTS.read_text())
    return subprocess.run([tool("promtool"), "test", "rules", "alerts.test.yml"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)


def test_a_mismatch_alert_per_stage_fails_the_unit_tests(tmp_path):
    """The per-room case can fail: counting stage verdicts fires once per stage that saw the room."""
    text = ALERTS.read_text()
    per_stage = text.replace("dsv4_idxk_probe_first_divergence_total", 'dsv4_idxk_probe_rooms_verified_total{verdict="mismatch"}')
    assert per_stage != text
    proc = promtool_tests_with(tmp_path, per_stage)
    assert proc.returncode != 0 and "Dsv4IdxkProbeIndexKMismatch" in proc.stdout + proc.stderr


def test_a_second_corrupt_room_notifies_again(tmp_path):
    """Without the count label the second room (minutes after the first) would be folded into
    the alert already firing: same labels, no new notification. The unit tests catch that."""
    text = ALERTS.read_text()
    folded = text.replace('          corrupt_rooms: "{{ $value }}"\n', "")
    assert folded != text
    proc = promtool_tests_with(tmp_path, folded)
    assert proc.returncode != 0 and "corrupt_rooms" in proc.stdout + proc.stderr


def test_summaries_count_whole_rooms_not_an_extrapolated_increase(tmp_path):
    """Four rooms on a young series read 5 through increase(); the alert says 4."""
    text = ALERTS.read_text()
    extrapolated = text.replace(
        "sum by (instance, engine_type, model_name, stage) (dsv4_idxk_probe_first_divergence_total)\n",
        "sum by (instance, engine_type, model_name, stage) (increase(dsv4_idxk_probe_first_divergence_total[10m]))\n", 1)
    assert extrapolated != text
    proc = promtool_tests_with(tmp_path, extrapolated)
    assert proc.returncode != 0 and '5 room(s)' in proc.stdout + proc.stderr
