"""The provisioning and scrape assets fit a typical stack (SGLang's own monitoring example,
kube-prometheus) without clashing with it, and `assets` writes all of them.

SGLang's examples/monitoring provisions a default data source named "Prometheus" and a
dashboard provider reading /var/lib/grafana/dashboards (and every folder below it).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess

import pytest
import yaml

from dsv4_idxk_probe.cli import assets

from tests.support.promql import ALERT_TESTS, ALERTS, REPO

GRAFANA = REPO / "configs" / "grafana"
PROMETHEUS_EXAMPLE = REPO / "configs" / "prometheus" / "prometheus.yml"
KUBERNETES = REPO / "configs" / "kubernetes"
SGLANG_PROVIDER_PATH = "/var/lib/grafana/dashboards"  # SGLang's grafana/dashboards/config/dashboard.yaml
SGLANG_DATASOURCE_NAME = "Prometheus"  # SGLang's grafana/datasources/datasource.yaml


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: run .ci/install-test-services.sh (make test does)")
    return path


def rule_generator():
    spec = importlib.util.spec_from_file_location("generate_rules", KUBERNETES / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_data_source_is_not_a_second_default_and_has_its_own_name():
    doc = yaml.safe_load((GRAFANA / "datasources.yaml").read_text())
    (source,) = doc["datasources"]
    assert source["type"] == "prometheus"
    assert source.get("isDefault") is False, "Grafana refuses a second default data source in an organisation"
    assert source["name"] != SGLANG_DATASOURCE_NAME and source["uid"] not in ("prometheus", ""), source


def test_the_dashboard_provider_reads_a_directory_of_its_own():
    doc = yaml.safe_load((GRAFANA / "dashboards.yaml").read_text())
    (provider,) = doc["providers"]
    assert doc["apiVersion"] == 1 and provider["type"] == "file"
    path = provider["options"]["path"].rstrip("/")
    # Under SGLang's provider path the dashboard would be provisioned twice (one uid, two providers).
    assert path != SGLANG_PROVIDER_PATH and not path.startswith(SGLANG_PROVIDER_PATH + "/"), path
    assert not SGLANG_PROVIDER_PATH.startswith(path + "/"), path


def test_the_example_scrape_config_has_no_always_down_job():
    doc = yaml.safe_load(PROMETHEUS_EXAMPLE.read_text())
    assert doc["rule_files"] == ["alerts.yml"]
    for job in doc.get("scrape_configs") or []:
        for group in job.get("static_configs", []):
            assert not [t for t in group["targets"] if re.match(r"(localhost|127\.|\[::1\])", t)], job["job_name"]
    proc = subprocess.run([tool("promtool"), "check", "config", str(PROMETHEUS_EXAMPLE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_commented_example_job_scrapes_sglangs_metrics_and_passes_promtool(tmp_path):
    text = PROMETHEUS_EXAMPLE.read_text()
    block = re.search(r"^# BEGIN example\n(.*?)^# END example", text, flags=re.M | re.S)
    assert block, "no commented example job between '# BEGIN example' and '# END example'"
    assert all(line.startswith("#") for line in block[1].splitlines())
    enabled = text.replace(block[1], "".join(line[1:] + "\n" for line in block[1].splitlines()))
    (tmp_path / "prometheus.yml").write_text(enabled)
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    (job,) = yaml.safe_load(enabled)["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and all(t.endswith(":30000") for t in job["static_configs"][0]["targets"])
    proc = subprocess.run([tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_podmonitor_scrapes_sglangs_metrics_and_labels_the_node():
    doc = yaml.safe_load((KUBERNETES / "podmonitor.yaml").read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PodMonitor"
    assert doc["metadata"]["name"] and doc["spec"]["selector"]["matchLabels"]
    (endpoint,) = doc["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"]
    # The dashboard's GPU row joins DCGM's Hostname with this label.
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node", "action": "replace"} in endpoint["relabelings"]


def test_the_prometheusrule_carries_exactly_the_alert_rules(tmp_path):
    text = (KUBERNETES / "prometheusrule.yaml").read_text()
    doc = yaml.safe_load(text)
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    assert doc["metadata"]["name"] == "dsv4-idxk-probe" and doc["metadata"]["labels"]
    assert doc["spec"] == yaml.safe_load(ALERTS.read_text()), "run: python configs/kubernetes/generate.py"
    assert rule_generator().render() == text, "run: python configs/kubernetes/generate.py"
    stale = tmp_path / "stale.yaml"
    stale.write_text(text.replace("severity: critical", "severity: page", 1))
    assert rule_generator().main(["--check", "-o", str(stale)]) == 1
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(doc["spec"]))
    proc = subprocess.run([tool("promtool"), "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def run_assets(out, *extra: str) -> int:
    parser = argparse.ArgumentParser()
    assets.add_arguments(parser)
    return assets.main(parser.parse_args(["--out", str(out), *extra]))


def test_assets_writes_the_kubernetes_files_too(tmp_path, capsys):
    assert run_assets(tmp_path) == 0
    written = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert {"kubernetes/podmonitor.yaml", "kubernetes/prometheusrule.yaml", "prometheus/alerts.yml",
            "grafana/dashboards/dsv4-idxk-probe.json"} <= written
    assert written == {relative for _, relative in assets.ASSETS}
    assert (tmp_path / "kubernetes" / "prometheusrule.yaml").read_text() == (KUBERNETES / "prometheusrule.yaml").read_text()


def test_assets_points_the_runbook_links_where_they_are_published(tmp_path, capsys):
    base = "https://wiki.example.org/sre/dsv4-idxk-probe/"
    assert run_assets(tmp_path, "--runbook-base-url", base) == 0
    alerts = yaml.safe_load((tmp_path / "prometheus" / "alerts.yml").read_text())
    rules = [rule for group in alerts["groups"] for rule in group["rules"]]
    assert rules and all(rule["annotations"]["runbook_url"] == f"{base}{rule['alert']}.md" for rule in rules)
    for relative in ("prometheus/alerts.yml", "prometheus/alerts.test.yml", "kubernetes/prometheusrule.yaml"):
        text = (tmp_path / relative).read_text()
        assert assets.RUNBOOK_BASE not in text and base in text, relative
    # The rewritten rules still pass their rewritten tests.
    proc = subprocess.run([tool("promtool"), "test", "rules", "alerts.test.yml"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path / "prometheus")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert assets.RUNBOOK_BASE in ALERTS.read_text() and assets.RUNBOOK_BASE in ALERT_TESTS.read_text()


@pytest.mark.parametrize("base", ["wiki/runbooks", "https://x/\x1b[31m", "https://x/\x85y", "https://x/{{.Labels.alertname}}"])
def test_assets_refuses_a_runbook_base_that_is_not_a_url(tmp_path, capsys, base):
    """A control character made rule files YAML parsers refuse, and "{{" a Prometheus template
    (both found by review)."""
    assert run_assets(tmp_path, "--runbook-base-url", base) == 2
    assert "--runbook-base-url" in capsys.readouterr().err
    assert not (tmp_path / "prometheus").exists()


def test_assets_to_the_home_of_an_unknown_user_exits_2_naming_the_option(tmp_path, capsys):
    """pathlib raises RuntimeError for ~user of no such user: a bad --out, not an internal error."""
    assert run_assets("~dsv4-no-such-user-zz/assets") == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4-idxk-probe assets: --out '~dsv4-no-such-user-zz/assets'") and "home directory" in err


def test_assets_prints_the_folder_it_was_given_escaped(tmp_path, capsys):
    """An --out holding an escape sequence reached the terminal raw, in every line naming a
    written file (found by review)."""
    assert run_assets(tmp_path / "out\x1b[31m") == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "out\\x1b[31m" in out


def test_install_hook_prints_its_folder_escaped_and_never_reads_a_foreign_file_whole(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    from dsv4_idxk_probe.cli import install_hook

    site = tmp_path / "site\x1b[2J"
    site.mkdir()
    (site / "dsv4_idxk_probe.pth").write_bytes(b"x" * (1 << 20))  # not ours: replaced, never read
    read = []
    real_read_text = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: read.append(self.name) or real_read_text(self, *a, **k))
    parser = argparse.ArgumentParser()
    install_hook.add_arguments(parser)
    assert install_hook.main(parser.parse_args(["--site-packages", str(site)])) == 0
    captured = capsys.readouterr()
    assert "\x1b" not in captured.out + captured.err and "site\\x1b[2J" in captured.out
    assert read.count("dsv4_idxk_probe.pth") == 1  # the package's own, not the foreign file
