"""The two start-up routes, each in a fresh interpreter (STYLE D5): SGLang's
plugin loader with the entry point pyproject.toml declares, and the `.pth`
file for builds without that loader. Both run against the real sglang==0.5.23."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HOOKS = REPO / "hooks"
GROUP = "sglang.srt.plugins"
PD_TARGETS = ("pd.send_kv_chunk", "pd.sender_send", "pd.send_kv_metadata", "pd.commit_transfer")


def run(code: str, tmp_path: Path, probe: str | None, extra_path: list[str] = (), timeout: int = 240) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV4_IDXK_PROBE", "SGLANG_PLUGINS"))}
    if probe is not None:
        env["DSV4_IDXK_PROBE"] = probe
        config = tmp_path / "probe.yaml"
        config.write_text(f"roomlog: {{dir: {tmp_path / 'logs'}}}\nexchange: {{bind: 127.0.0.1}}\n")
        env["DSV4_IDXK_PROBE_CONFIG"] = str(config)
    env["PYTHONPATH"] = os.pathsep.join([*extra_path, env.get("PYTHONPATH", "")])
    env["PYTHONWARNINGS"] = "ignore"
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# %% .pth route


PTH_CODE = f"""
    import json, site, sys
    site.addsitedir({str(HOOKS)!r})  # processes hooks/dsv4_idxk_probe.pth as site-packages would
    before = sorted(m for m in sys.modules if m.startswith(("dsv4_idxk_probe", "sglang", "wrapt")))
    result = {{"before": before}}
    if IMPORT_SGLANG:
        import pickle
        import wrapt
        import sglang.srt.managers.scheduler as scheduler
        import sglang.srt.disaggregation.prefill as prefill
        from dsv4_idxk_probe import activation
        entry = scheduler.run_scheduler_process
        result.update(loaded_before_a_scheduler_starts=activation.loaded,
                      entry_pickles_as_itself=pickle.loads(pickle.dumps(entry)) is entry)
        if START == "entry":
            entry.__wrapped__ = lambda *args: "scheduler ran"  # SGLang's own would start a scheduler
            result.update(entry_returned=entry(), loaded=activation.loaded)
        else:  # SGLang's Ray actor builds a Scheduler without the entry
            scheduler.Scheduler.__init__.__wrapped__ = lambda self, *args: None
            scheduler.Scheduler()
            result.update(entry_returned="scheduler ran", loaded=activation.loaded)
        wrapper = prefill.SchedulerDisaggregationPrefillMixin.__dict__["send_kv_chunk"]
        runtime = activation.current_runtime()
        result.update(wrapped=isinstance(wrapper, wrapt.FunctionWrapper),
                      status={{k: v[0] for k, v in runtime.patcher.status.items()}})
    print(json.dumps(result))
"""


def test_pth_with_variable_unset_imports_no_probe_module(tmp_path):
    result = run(PTH_CODE.replace("IMPORT_SGLANG", "False"), tmp_path, probe=None)
    assert result == {"before": []}


@pytest.mark.parametrize("start", ["entry", "constructor"])
def test_pth_route_installs_when_a_scheduler_starts_and_patches_what_it_imports(tmp_path, start):
    """Installed first thing in SGLang's scheduler entry, as the plugin loader does, and not on
    `import sglang`: SGLang's HTTP server, tokenizer and detokenizer processes import the
    scheduler module (to start schedulers) but never run its entry, and got the probe (0.2-0.3 s
    each, and what it patched there). The entry wrapped still pickles as itself (spawn); the
    Scheduler's constructor installs too (SGLang's Ray actor never calls the entry)."""
    result = run(PTH_CODE.replace("IMPORT_SGLANG", "True").replace("START", repr(start)), tmp_path, probe="1")
    # armed, nothing else yet: the package (its version) and the stdlib-only bootstrap
    assert result["before"] == ["dsv4_idxk_probe", "dsv4_idxk_probe.bootstrap", "dsv4_idxk_probe.version"]
    assert (result["loaded_before_a_scheduler_starts"], result["entry_pickles_as_itself"]) == (False, True)
    assert (result["entry_returned"], result["loaded"]) == ("scheduler ran", True)
    assert result["wrapped"]
    assert result["status"]["pd.send_kv_chunk"] == "patched"


def test_pth_route_installs_nothing_in_sglang_s_other_processes(tmp_path):
    code = f"""
        import json, site, sys
        site.addsitedir({str(HOOKS)!r})
        import sglang.srt.managers.detokenizer_manager, sglang.srt.managers.tokenizer_manager
        import sglang.srt.entrypoints.http_server  # binds the scheduler entry, calls it only in its children
        probe_modules = sorted(m for m in sys.modules if m.startswith("dsv4_idxk_probe."))
        from dsv4_idxk_probe import activation
        print(json.dumps({{"loaded": activation.loaded, "probe_modules": probe_modules}}))
    """
    result = run(code, tmp_path, probe="1")
    assert result == {"loaded": False, "probe_modules": ["dsv4_idxk_probe.bootstrap", "dsv4_idxk_probe.version"]}


@pytest.mark.parametrize("probe", [None, "1", "0"])
def test_a_pth_left_after_uninstall_prints_no_traceback(tmp_path, probe):
    """Issue "Reliability round two": `pip uninstall` leaves the .pth that install-hook copied,
    and every Python start printed a traceback. Now: nothing, or (variable set) one short line."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copy(HOOKS / "dsv4_idxk_probe.pth", site_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV4_IDXK_PROBE", "PYTHON"))}
    if probe is not None:
        env["DSV4_IDXK_PROBE"] = probe
    # -S: no site-packages, so the package is not importable, as after `pip uninstall`
    code = f"import site, sys; site.addsitedir({str(site_dir)!r}); print('dsv4_idxk_probe' in sys.modules)"
    out = subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert (out.returncode, out.stdout) == (0, "False\n"), out.stderr
    assert "Traceback" not in out.stderr and "Error processing line" not in out.stderr, out.stderr
    if probe == "1":
        assert len(out.stderr.splitlines()) == 1 and len(out.stderr) < 300, out.stderr
        assert "DSV4_IDXK_PROBE is set" in out.stderr and "No module named 'dsv4_idxk_probe'" in out.stderr
    else:
        assert out.stderr == ""


# %% plugin entry point


def declared_entry_points() -> dict:
    project = tomllib.loads((REPO / "pyproject.toml").read_text()).get("project", {})
    return project.get("entry-points", {}).get(GROUP, {})


def test_plugin_entry_point_is_declared():
    declared = declared_entry_points()
    assert declared == {"dsv4_idxk_probe": "dsv4_idxk_probe.activation:load_plugin"}, (
        f'pyproject.toml must declare:\n[project.entry-points."{GROUP}"]\n'
        'dsv4_idxk_probe = "dsv4_idxk_probe.activation:load_plugin"'
    )


PLUGIN_CODE = """
    import json
    # a scheduler process has imported the PD modules when run_scheduler_process calls load_plugins()
    import sglang.srt.disaggregation.common.conn, sglang.srt.disaggregation.decode, sglang.srt.disaggregation.prefill
    import sglang.srt.managers.scheduler_components.batch_result_processor
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    def run_scheduler_process():  # the name SGLang's scheduler entry has: plugins load inside it
        load_plugins()

    if IN_SCHEDULER:
        run_scheduler_process()
    else:
        load_plugins()  # SGLang's HTTP server, tokenizer and detokenizer processes call it too
    from dsv4_idxk_probe import activation
    runtime = activation.current_runtime()
    status = runtime.patcher.verify() if runtime else {}
    print(json.dumps({"loaded": activation.loaded, "status": {k: v[0] for k, v in status.items()},
                      "registered": sorted(HookRegistry._hooks)}))
"""


def test_sglang_plugin_loader_runs_the_declared_entry_point(tmp_path):
    """A distribution carrying exactly the declared entry point, loaded by SGLang's real load_plugins()."""
    check_loader_with(declared_entry_points(), tmp_path)


def write_entry_points(entry_points: dict, tmp_path: Path) -> None:
    """A distribution carrying exactly these entry points, in tmp_path/site."""
    dist = tmp_path / "site" / "dsv4_idxk_probe_entry_point_check-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dsv4-idxk-probe-entry-point-check\nVersion: 0.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (dist / "entry_points.txt").write_text(f"[{GROUP}]\n{lines}")


def check_loader_with(entry_points: dict, tmp_path: Path) -> None:
    assert entry_points, f"no [project.entry-points.\"{GROUP}\"] in pyproject.toml"
    write_entry_points(entry_points, tmp_path)
    result = run(PLUGIN_CODE.replace("IN_SCHEDULER", "True"), tmp_path, probe="1", extra_path=[str(tmp_path / "site")])
    assert result["loaded"]
    for name in PD_TARGETS:
        assert result["status"][name] == "patched", result["status"]
    assert "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.send_kv_chunk" in result["registered"]


def test_plugin_outside_a_scheduler_process_installs_nothing(tmp_path):
    """Finding 7: SGLang's loader also runs in its HTTP, tokenizer and detokenizer
    processes; the probe (and its exporter) start only where a scheduler starts."""
    write_entry_points(declared_entry_points(), tmp_path)
    code = PLUGIN_CODE.replace("IN_SCHEDULER", "False").replace(
        "status = runtime.patcher.verify() if runtime else {}", "status = {}")
    result = run(code, tmp_path, probe="1", extra_path=[str(tmp_path / "site")])
    assert result["loaded"] is False and result["registered"] == []


def test_install_hook_into_the_home_of_an_unknown_user_exits_2_naming_the_option(capsys):
    """pathlib raises RuntimeError for ~user of no such user: a bad --site-packages, said in one
    line with exit 2 like a missing directory, never an internal error."""
    import argparse

    from dsv4_idxk_probe.cli import install_hook

    parser = argparse.ArgumentParser()
    install_hook.add_arguments(parser)
    args = parser.parse_args(["--site-packages", "~dsv4-no-such-user-zz/site-packages"])
    assert install_hook.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4-idxk-probe install-hook: --site-packages '~dsv4-no-such-user-zz/site-packages'")
    assert "home directory" in err
