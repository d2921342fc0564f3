"""What an operator gets from `pip install`: the built wheel, alone in a fresh venv.

The wheel is built from this checkout (`pip wheel --no-build-isolation`, so no
download), installed with `--no-deps` into a new venv that sees the test
environment's site-packages only as a plain path (torch, numpy, SGLang are
not installed twice; this checkout is not on it). Every command then runs
from a directory outside the source tree, through the console script the
wheel installed, and must find its files inside the installed package.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.support.logdata import Fault, RoomPlan, write_logs

REPO = Path(__file__).resolve().parents[2]


def sh(*cmd, cwd, env=None, timeout=300, expect=0):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == expect, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, console script, clean env, a working dir outside the repo)."""
    root = tmp_path_factory.mktemp("wheel")
    # No PYTHONPATH: a checkout on it (with the egg-info an in-tree build leaves) would
    # look to pip like dsv4-idxk-probe is installed already.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV4_IDXK_PROBE", "PYTHONPATH", "PROMETHEUS"))}
    sh(sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "-q", "--no-deps", "--no-build-isolation",
       "-w", root / "dist", REPO, cwd=root, env=env)
    (wheel,) = (root / "dist").glob("dsv4_idxk_probe-*.whl")
    venv = root / "venv"
    sh(sys.executable, "-m", "venv", "--without-pip", venv, cwd=root, env=env)
    python = venv / "bin" / "python"
    sh(sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", python, "install", "-q", "--no-deps",
       "--no-index", wheel, cwd=root, env=env)
    site = Path(sh(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=root, env=env).stdout.strip())
    assert (venv / "bin" / "dsv4-idxk-probe").is_file(), "pip did not install the wheel's console script"
    # The dependencies, as a plain path (its .pth files, such as an editable install of this checkout, stay unread).
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = root / "work"
    work.mkdir()
    return python, venv / "bin" / "dsv4-idxk-probe", env, work, wheel, site


def test_the_wheel_carries_the_hook_dashboards_rules_and_license(installed):
    *_, wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for inside in ("dsv4_idxk_probe/hooks/dsv4_idxk_probe.pth", "dsv4_idxk_probe/dashboards/dsv4-idxk-probe.json",
                   "dsv4_idxk_probe/configs/prometheus/alerts.yml", "dsv4_idxk_probe/configs/prometheus/alerts.test.yml",
                   "dsv4_idxk_probe/configs/grafana/dashboards.yaml", "dsv4_idxk_probe/configs/targets/sglang.yaml"):
        assert inside in names, inside
    assert not [n for n in names if n.endswith("generate.py")], "the dashboard generator is a dev tool"
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta
    assert any(n.endswith("licenses/LICENSE") for n in names)


def test_the_installed_package_is_the_wheels_not_this_checkout(installed):
    python, _, env, work, _, site = installed
    where = sh(python, "-c", "import dsv4_idxk_probe; print(dsv4_idxk_probe.__file__)", cwd=work, env=env).stdout
    assert where.strip().startswith(str(site)), where


def test_install_hook_gates_on_the_variable_and_uninstalls(installed):
    python, cli, env, work, _, site = installed
    out = sh(cli, "install-hook", cwd=work, env=env).stdout
    assert (site / "dsv4_idxk_probe.pth").read_text() == (REPO / "hooks" / "dsv4_idxk_probe.pth").read_text(), out
    assert "already installed" in sh(cli, "install-hook", cwd=work, env=env).stdout
    probe = "import sys; print('dsv4_idxk_probe.bootstrap' in sys.modules)"
    assert sh(python, "-c", probe, cwd=work, env=env).stdout.strip() == "False"
    assert sh(python, "-c", probe, cwd=work, env={**env, "DSV4_IDXK_PROBE": "1"}).stdout.strip() == "True"
    sh(cli, "install-hook", "--uninstall", cwd=work, env=env)
    assert not (site / "dsv4_idxk_probe.pth").exists()
    assert sh(python, "-c", probe, cwd=work, env={**env, "DSV4_IDXK_PROBE": "1"}).stdout.strip() == "False"
    other = work / "elsewhere"
    other.mkdir()
    sh(cli, "install-hook", "--site-packages", other, cwd=work, env=env)
    assert (other / "dsv4_idxk_probe.pth").is_file()
    err = sh(cli, "install-hook", "--site-packages", work / "missing", cwd=work, env=env, expect=2).stderr
    assert "dsv4-idxk-probe install-hook:" in err and "Traceback" not in err


def test_assets_writes_what_grafana_and_prometheus_load(installed):
    _, cli, env, work, _, _ = installed
    out = work / "assets"
    sh(cli, "assets", "--out", out, cwd=work, env=env)
    dashboard = json.loads((out / "grafana" / "dashboards" / "dsv4-idxk-probe.json").read_text())
    assert dashboard == json.loads((REPO / "dashboards" / "dsv4-idxk-probe.json").read_text())
    for relative in ("grafana/provisioning/dashboards/dsv4-idxk-probe.yaml", "grafana/provisioning/datasources/prometheus.yaml",
                     "prometheus/prometheus.yml", "hooks/dsv4_idxk_probe.pth", "probe.example.yaml"):
        assert (out / relative).is_file(), relative
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed: run .ci/install-test-services.sh (make test does)"
    sh(promtool, "test", "rules", "alerts.test.yml", cwd=out / "prometheus")


def test_check_validates_the_config_a_pod_would_load(installed):
    _, cli, env, work, _, _ = installed
    bad = work / "bad.yaml"
    bad.write_text("roomlog:\n  max_files: none\n")
    err = sh(cli, "check", cwd=work, env={**env, "DSV4_IDXK_PROBE": "1", "DSV4_IDXK_PROBE_CONFIG": str(bad)}, expect=2).stderr
    err = " ".join(err.split())  # messages are wrapped at 100 columns
    assert "roomlog.max_files" in err and str(bad) in err and "Traceback" not in err
    good = work / "good.yaml"
    good.write_text("mode: observe\n")
    out = sh(cli, "check", cwd=work, env={**env, "DSV4_IDXK_PROBE": "1", "DSV4_IDXK_PROBE_CONFIG": str(good)}).stdout
    assert f"config: {good} is valid; probe on, mode observe" in " ".join(out.split())


def test_diff_and_report_from_the_wheel(installed, tmp_path):
    _, cli, env, work, _, _ = installed
    prefill, decode = write_logs(tmp_path / "logs", [RoomPlan(1), RoomPlan(12, fault=Fault(1, 2, 8, "decode_step"))])
    out = sh(cli, "diff", prefill, decode, "--json", work / "diff.json", cwd=work, env=env, expect=1).stdout
    assert "12/0" in out
    assert json.loads((work / "diff.json").read_text())["summary"]["room_verdicts"]["mismatch"] == 1
    sh(cli, "report", prefill, decode, "-o", work / "report.html", cwd=work, env=env)
    assert 'class="heatmap"' in (work / "report.html").read_text()


def test_demo_from_the_wheel(installed):
    """`demo --help`, and the built-in rig's smallest clean run on CPU (about 40 s, mostly start-up)."""
    _, cli, env, work, _, _ = installed
    assert "--rooms" in sh(cli, "demo", "--help", cwd=work, env=env).stdout
    out = sh(cli, "demo", "--rooms", "4", "--layers", "2", "--no-faults", "--device", "cpu", "--pool-source", "builtin",
             "--metrics-port", "-1", "--plain", cwd=work, env=env, timeout=280).stdout
    assert "RESULT: every injected fault found" in out
    assert list((work / "probe-logs").iterdir())
