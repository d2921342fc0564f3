"""`dsv4-idxk-probe assets --out DIR`: the files an operator deploys around the probe.

Writes, from the installed package (so they match the installed version):

    DIR/grafana/dashboards/dsv4-idxk-probe.json          the dashboard
    DIR/grafana/provisioning/dashboards/dsv4-idxk-probe.yaml   file provider
    DIR/grafana/provisioning/datasources/prometheus.yaml       a Prometheus data source
    DIR/prometheus/alerts.yml, alerts.test.yml                 rules and their promtool tests
    DIR/prometheus/prometheus.yml                              example config that loads the rules
    DIR/kubernetes/podmonitor.yaml                             Prometheus Operator: scrape SGLang's /metrics
    DIR/kubernetes/prometheusrule.yaml                         Prometheus Operator: the same rules
    DIR/hooks/dsv4_idxk_probe.pth                              the .pth gate (see install-hook)
    DIR/probe.example.yaml                                     an annotated probe config

for a config-management tool (Helm chart, Ansible, a ConfigMap) to pick up.
Every alert links its runbook (docs/runbooks/<alert>.md) under a placeholder
address; ``--runbook-base-url URL`` writes the rules, their tests and the
PrometheusRule with the address where you publish that folder instead.
Files are replaced in place (temp file, then rename); nothing else in DIR is
touched. Exit 0 written, 2 a file is missing from the package, DIR cannot be
written, or the runbook URL is not an http(s) URL.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from ..offline.printable import printable
from .atomic import write_atomically

HELP = "write the Grafana dashboard, Prometheus rules and PodMonitor for your monitoring stack into a folder"

# (path inside the package, path under --out)
ASSETS = (
    ("dashboards/dsv4-idxk-probe.json", "grafana/dashboards/dsv4-idxk-probe.json"),
    ("configs/grafana/dashboards.yaml", "grafana/provisioning/dashboards/dsv4-idxk-probe.yaml"),
    ("configs/grafana/datasources.yaml", "grafana/provisioning/datasources/prometheus.yaml"),
    ("configs/prometheus/alerts.yml", "prometheus/alerts.yml"),
    ("configs/prometheus/alerts.test.yml", "prometheus/alerts.test.yml"),
    ("configs/prometheus/prometheus.yml", "prometheus/prometheus.yml"),
    ("configs/kubernetes/podmonitor.yaml", "kubernetes/podmonitor.yaml"),
    ("configs/kubernetes/prometheusrule.yaml", "kubernetes/prometheusrule.yaml"),
    ("hooks/dsv4_idxk_probe.pth", "hooks/dsv4_idxk_probe.pth"),
    ("configs/probe.example.yaml", "probe.example.yaml"),
)


# Where the shipped rules say the runbooks are; --runbook-base-url replaces it.
RUNBOOK_BASE = "https://runbooks.example.com/dsv4-idxk-probe"


def package_root() -> Path:
    return Path(__file__).resolve().parents[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write into (created if missing)")
    parser.add_argument("--runbook-base-url", metavar="URL", default=None,
                        help=f"where docs/runbooks/ is published: each alert's runbook_url becomes URL/<alert>.md "
                             f"(default: the placeholder {RUNBOOK_BASE})")


def _fail(message: str) -> int:
    print(f"dsv4-idxk-probe assets: {printable(message)}", file=sys.stderr)
    return 2


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, data)


def with_runbook_base(data: bytes, base: str | None) -> bytes:
    """`data` with the shipped runbook address replaced by `base` (no trailing slash)."""
    if not base:
        return data
    return data.replace(RUNBOOK_BASE.encode() + b"/", base.rstrip("/").encode() + b"/")


def main(args: argparse.Namespace) -> int:
    root = package_root()
    try:
        out = Path(args.out).expanduser()
    except RuntimeError:  # pathlib's answer to ~user of no known user, or ~ with no home
        return _fail(f"--out {args.out!r} starts with a '~' whose home directory is unknown here")
    base = getattr(args, "runbook_base_url", None)
    if base is not None and (not base.startswith(("https://", "http://")) or "{{" in base
                             or any(c.isspace() or c in "\"'" or not c.isprintable() for c in base)):
        # a control character made files YAML parsers refuse; "{{" Prometheus reads as a template
        return _fail(f"--runbook-base-url must be an http(s) URL without spaces, quotes, control characters or "
                     f"'{{{{', got {base!r}")
    sources = []
    for inside, _ in ASSETS:
        try:
            sources.append(with_runbook_base((root / inside).read_bytes(), base))
        except OSError as exc:
            return _fail(f"{root / inside}: {exc.strerror or exc}; reinstall dsv4-idxk-probe")
    for (_, relative), data in zip(ASSETS, sources):
        try:
            _write(out / relative, data)
        except OSError as exc:
            return _fail(f"cannot write {out / relative}: {exc.strerror or exc}")
        print(printable(out / relative))
    print(f"{len(ASSETS)} files written; mount grafana/provisioning/* under /etc/grafana/provisioning/ and copy "
          "grafana/dashboards/ to the provider's path, or apply kubernetes/* with the Prometheus Operator "
          "(see docs/observability.md)", file=sys.stderr)
    return 0
