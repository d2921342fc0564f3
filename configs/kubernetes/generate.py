#!/usr/bin/env python3
"""Write configs/kubernetes/prometheusrule.yaml from configs/prometheus/alerts.yml.

The PrometheusRule carries alerts.yml's groups, comments and all, under
``spec``: one set of rules, two ways to load them. ``--check`` exits 1 when
the checked-in file differs from what this script writes (the test suite runs
the same check, and holds the parsed ``spec`` equal to alerts.yml).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ALERTS = HERE.parent / "prometheus" / "alerts.yml"
OUTPUT = HERE / "prometheusrule.yaml"

HEADER = """\
# Generated from configs/prometheus/alerts.yml by configs/kubernetes/generate.py:
# edit alerts.yml and run `python configs/kubernetes/generate.py`.
#
# The dsv4-idxk-probe alert rules for the Prometheus Operator (kube-prometheus,
# kube-prometheus-stack): `kubectl apply -n <monitoring namespace> -f prometheusrule.yaml`.
# Its labels must match your Prometheus's ruleSelector: kube-prometheus-stack
# selects `release: <its Helm release>` by default, kube-prometheus
# `prometheus: k8s` and `role: alert-rules`; keep the ones yours uses. The
# annotations use Prometheus's own templates ({{ $value }}): inside a Helm chart,
# escape them ({{ "{{" }} $value }}) or load this file with .Files.Get.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: dsv4-idxk-probe
  labels:
    app.kubernetes.io/name: dsv4-idxk-probe
    app.kubernetes.io/component: alert-rules
    prometheus: k8s
    role: alert-rules
    release: kube-prometheus-stack
spec:
"""


def render(alerts: str | None = None) -> str:
    """The PrometheusRule: HEADER, then alerts.yml from its `groups:` line on, indented under spec."""
    text = ALERTS.read_text(encoding="utf-8") if alerts is None else alerts
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("groups:"))
    body = "\n".join(("  " + line) if line.strip() else "" for line in lines[start:])
    return HEADER + body + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the checked-in file is out of date")
    parser.add_argument("-o", "--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date: run python configs/kubernetes/generate.py", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
