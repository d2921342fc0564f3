"""install() / uninstall(): env gate, one try around start-up, idempotence, round trips."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import act_fixture_host as host
import pytest
import wrapt
from prometheus_client import CollectorRegistry

from dsv4_idxk_probe import activation

TABLE = f"""
targets:
  - name: act.step
    module: {host.__name__}
    qualname: Engine.step
    params: [self, x]
    kind: around
    hook: "{host.__name__}:make_counting_wrapper"
    required: true
    role: any
"""


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "targets.yaml"
    path.write_text(TABLE)
    return path


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    from dsv4_idxk_probe.sglang import targets

    # the stand-in host's factory is not one of the probe's own (targets.hook_problem)
    monkeypatch.setattr(targets, "EXTRA_HOOK_MODULES", frozenset({host.__name__}))
    activation.uninstall()
    host.calls.clear()
    yield
    activation.uninstall()


def env_for(table, **extra):
    return {"DSV4_IDXK_PROBE": "1", "DSV4_IDXK_PROBE_TARGETS": str(table), **extra}


def install(env):
    records = []
    return activation.install(env, registry=CollectorRegistry(), emit=records.append)


@pytest.mark.parametrize("value", [None, "", "0", "off"])
def test_off_values_do_nothing(table, value):
    env = env_for(table)
    if value is None:
        del env["DSV4_IDXK_PROBE"]
    else:
        env["DSV4_IDXK_PROBE"] = value
    assert install(env) is False
    assert activation.loaded is False
    assert not isinstance(host.Engine.__dict__["step"], wrapt.FunctionWrapper)


def test_install_uninstall_round_trip(table):
    original = host.Engine.__dict__["step"]
    assert install(env_for(table)) is True and activation.loaded
    assert host.Engine().step(1) == 2 and host.calls == [(1,)]
    assert install(env_for(table)) is True  # idempotent: no second wrapper
    assert not isinstance(host.Engine.__dict__["step"].__wrapped__, wrapt.ObjectProxy)
    activation.uninstall()
    assert host.Engine.__dict__["step"] is original and not activation.loaded
    assert host.Engine().step(1) == 2 and host.calls == [(1,)]
    activation.uninstall()  # idempotent
    assert install(env_for(table)) is True
    assert host.Engine().step(5) == 6 and host.calls == [(1,), (5,)]
    assert activation.current_runtime().patcher.status["act.step"][0] == "patched"


def test_invalid_config_keeps_the_probe_off_and_names_the_field(table, tmp_path, caplog):
    bad = tmp_path / "probe.yaml"
    bad.write_text("exchange:\n  timeout_ms: soon\n")
    with caplog.at_level(logging.ERROR, logger="dsv4_idxk_probe"):
        assert install(env_for(table, DSV4_IDXK_PROBE_CONFIG=str(bad))) is False
    assert f"{bad}:2: exchange.timeout_ms must be an integer >= 1, got 'soon'" in caplog.text
    assert "stays off (serving continues)" in caplog.text
    assert host.Engine().step(1) == 2 and host.calls == []


def test_invalid_target_table_keeps_the_probe_off(tmp_path, caplog):
    bad = tmp_path / "targets.yaml"
    bad.write_text("targets:\n  - name: a\n    kind: after\n")
    with caplog.at_level(logging.ERROR, logger="dsv4_idxk_probe"):
        assert install(env_for(bad)) is False
    assert f"{bad}:2: targets[0] (a).module must be a non-empty string" in caplog.text


def test_unexpected_start_up_failure_is_contained(table, monkeypatch, caplog):
    from dsv4_idxk_probe.sglang import patcher

    def explode(self):
        raise RuntimeError("start-up bug")

    monkeypatch.setattr(patcher.Patcher, "patch", explode)
    with caplog.at_level(logging.ERROR, logger="dsv4_idxk_probe"):
        assert install(env_for(table)) is False
    assert "failed to start; serving continues without it" in caplog.text
    assert activation.loaded is False and activation.current_runtime() is None


def test_unset_variable_imports_nothing_heavy():
    code = textwrap.dedent("""
        import sys
        from dsv4_idxk_probe import activation
        activation.load_plugin()
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "sglang", "wrapt", "zmq", "yaml", "numpy")
                       or m.startswith("dsv4_idxk_probe.") and m not in (
                           "dsv4_idxk_probe.activation", "dsv4_idxk_probe.environment_variables", "dsv4_idxk_probe.version"))
        print(activation.loaded, heavy)
    """)
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("DSV4_IDXK_PROBE")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False []", out.stderr


@pytest.mark.parametrize("allowed, problem", [
    (None, False), ("", False), ("dsv4_idxk_probe", False), ("other, dsv4_idxk_probe", False), ("other", True),
])
def test_an_sglang_plugins_allowlist_that_drops_the_probe_is_named(allowed, problem):
    """Finding 7: SGLANG_PLUGINS loads only what it lists; `check` and the .pth route say so."""
    from dsv4_idxk_probe.activation import allowlist_problem

    env = {"DSV4_IDXK_PROBE": "1"} | ({} if allowed is None else {"SGLANG_PLUGINS": allowed})
    message = allowlist_problem(env)
    assert bool(message) == problem
    if problem:
        assert "SGLANG_PLUGINS" in message and "dsv4_idxk_probe" in message
    assert allowlist_problem({"SGLANG_PLUGINS": "other"}) is None  # probe not asked for: nothing to say


def test_check_fails_when_the_allowlist_drops_the_probe(capsys, monkeypatch):
    from dsv4_idxk_probe.cli.main import run

    monkeypatch.setenv("DSV4_IDXK_PROBE", "1")
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    assert run(["check"]) == 1
    assert "does not list 'dsv4_idxk_probe'" in capsys.readouterr().err
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else,dsv4_idxk_probe")
    assert run(["check"]) == 0
