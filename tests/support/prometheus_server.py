"""A real Prometheus on loopback, for the tests that check the dashboard and alert queries
against one (tests/observability, tests/sglang_rig); every wait has a deadline."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tests.support.promql import ALERTS

LOOPBACK = "127.0.0.1"
DEADLINE_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def wait_for(what: str, check, timeout: float = DEADLINE_S, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


class Prometheus:
    """A Prometheus process scraping `targets` every second, with the shipped alert rules;
    `jobs` (job name -> static target groups, each with its own labels) replaces the one job."""

    def __init__(self, binary, tmp_path, targets=(), *, jobs: dict[str, list[dict]] | None = None):
        if jobs is None:
            jobs = {"dsv4-idxk-probe": [{"targets": list(targets)}]}
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        rules = tmp_path / "alerts.yml"
        shutil.copy(ALERTS, rules)
        config = tmp_path / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": job, "static_configs": groups} for job, groups in jobs.items()],
        }))
        self.log = open(tmp_path / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address={LOOPBACK}:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )

    def get(self, path: str, **params):
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:  # 400 carries Prometheus's parse error
            return json.loads(exc.read())

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited with {self.proc.returncode}; see {self.log.name}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def query(self, expr: str) -> dict:
        return self.get("/api/v1/query", query=expr)

    def series(self, expr: str) -> list:
        answer = self.query(expr)
        return answer["data"]["result"] if answer.get("status") == "success" else []

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()
