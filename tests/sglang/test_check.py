"""`check` as an operator meets it: outside the serving image, with a log directory it cannot
write, with an exchange that would stay on loopback, and on a terminal 100 columns wide."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_idxk_probe.cli import check, progress

REPO = Path(__file__).resolve().parents[2]
WIDTH = 100


def _check(capsys, monkeypatch, config: str | None = None, tmp_path: Path | None = None, json_out=False, **env):
    for name in ("DSV4_IDXK_PROBE_CONFIG", "DSV4_IDXK_PROBE_EXCHANGE_SECRET_FILE", "SGLANG_HOST_IP", "HOST_IP"):
        monkeypatch.delenv(name, raising=False)
    if config is not None:
        path = tmp_path / "probe.yaml"
        path.write_text(config)
        monkeypatch.setenv("DSV4_IDXK_PROBE_CONFIG", str(path))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    rc = check.main(argparse.Namespace(targets=None, json=json_out))
    return rc, capsys.readouterr()


def _wide(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line) > WIDTH]


# %% outside the serving image


def _fake_sglang(root: Path, kind: str) -> Path:
    """An `sglang` that shadows the real one: absent altogether, or present with a dependency missing."""
    pkg = root / "sglang"
    (pkg / "srt").mkdir(parents=True)
    if kind == "absent":
        (pkg / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'sglang'\", name='sglang')\n")
    else:
        (pkg / "__init__.py").write_text("")
        (pkg / "srt" / "__init__.py").write_text("import sgl_kernel_not_in_this_image\n")
    return root


@pytest.mark.parametrize("kind, reason", [("absent", "No module named 'sglang'"),
                                          ("broken", "No module named 'sgl_kernel_not_in_this_image'")])
def test_check_outside_the_serving_image_says_so_once_with_its_own_exit_status(tmp_path, kind, reason):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_IDXK_PROBE")}
    env["PYTHONPATH"] = os.pathsep.join([str(_fake_sglang(tmp_path / "fake", kind)), str(REPO)])
    proc = subprocess.run([sys.executable, "-m", "dsv4_idxk_probe", "check"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    both = proc.stdout + proc.stderr
    assert proc.returncode == 4, both
    said = " ".join(proc.stderr.split())  # the message is wrapped at 100 columns
    assert said.count("run this inside the serving image: sglang is not importable: ") == 1, both
    assert said.count(reason) == 1 and "Traceback" not in both, both
    assert "missing" not in proc.stdout and "targets resolve" not in proc.stdout, proc.stdout
    assert _wide(both) == []


def test_the_help_names_exit_status_4(capsys):
    from dsv4_idxk_probe.cli.main import run

    with pytest.raises(SystemExit):
        run(["check", "--help"])
    assert "4    check only: SGLang is not importable here" in capsys.readouterr().out


# %% progress and width


def test_check_shows_progress_on_stderr_while_importing_sglang(capsys, monkeypatch):
    monkeypatch.setattr(progress, "QUIET_S", 0.0)  # SGLang is imported already here: every step is short
    rc, out = _check(capsys, monkeypatch)
    assert rc == 0, out.err
    assert "dsv4-idxk-probe check: importing SGLang" in out.err and ": done in " in out.err, out.err
    assert "importing SGLang" not in out.out  # stdout stays the report


def test_every_line_of_check_fits_in_100_columns(capsys, monkeypatch):
    rc, out = _check(capsys, monkeypatch)
    assert rc == 0, out.err
    assert _wide(out.out + out.err) == []
    assert out.out.count("\nok ") > 10  # the table itself is there


# %% the room-log directory


def test_a_room_log_dir_that_cannot_be_created_fails_check_naming_the_field(tmp_path, capsys, monkeypatch):
    rc, out = _check(capsys, monkeypatch, "roomlog:\n  dir: /proc/nope\n", tmp_path)
    assert rc == 2, out.out + out.err
    assert "roomlog.dir" in out.err and "/proc/nope" in out.err and str(tmp_path / "probe.yaml") in out.err
    assert "Traceback" not in out.err and _wide(out.err) == []


def test_a_relative_room_log_dir_inside_the_config_folder_is_named_as_such(tmp_path, capsys, monkeypatch):
    (tmp_path / "logs").write_text("a file where the directory would go")
    rc, out = _check(capsys, monkeypatch, "roomlog:\n  dir: logs/rooms\n", tmp_path)
    assert rc == 2, out.out + out.err
    assert "roomlog.dir" in out.err and "resolved against the config file's folder" in out.err


def test_a_writable_room_log_dir_passes_is_shown_and_is_left_as_it_was(tmp_path, capsys, monkeypatch):
    target = tmp_path / "var" / "log" / "probe"
    rc, out = _check(capsys, monkeypatch, f"roomlog:\n  dir: {target}\n", tmp_path)
    assert rc == 0, out.err
    assert f"room logs: {target}" in out.out
    assert not (tmp_path / "var").exists()  # check created it to try, then removed it


# %% the exchange on loopback (issue 31 item 5)


def _secret(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_text("0123456789abcdef0123456789abcdef\n")
    path.chmod(0o600)
    return path


def test_check_warns_when_the_exchange_would_stay_on_loopback_on_a_routable_host(tmp_path, capsys, monkeypatch):
    logs = tmp_path / "logs"
    rc, out = _check(capsys, monkeypatch, f"roomlog:\n  dir: {logs}\n", tmp_path, SGLANG_HOST_IP="10.1.2.3")
    assert rc == 0, out.err
    warning = " ".join(out.out.split()).split("warning: exchange: ")[1]
    assert "no exchange.secret_file" in warning and "10.1.2.3" in warning
    rc, out = _check(capsys, monkeypatch, f"roomlog:\n  dir: {logs}\n", tmp_path, json_out=True, SGLANG_HOST_IP="10.1.2.3")
    assert any("10.1.2.3" in w for w in json.loads(out.out)["warnings"])


@pytest.mark.parametrize("case", ["loopback host", "secret"])
def test_no_exchange_warning_when_the_host_is_loopback_or_peers_authenticate(tmp_path, capsys, monkeypatch, case):
    config = f"roomlog:\n  dir: {tmp_path / 'logs'}\n"
    if case == "secret":
        config += f"exchange:\n  secret_file: {_secret(tmp_path)}\n"
    rc, out = _check(capsys, monkeypatch, config, tmp_path,
                     SGLANG_HOST_IP="127.0.0.1" if case == "loopback host" else "10.1.2.3")
    assert rc == 0, out.err
    assert "warning: exchange:" not in out.out


# %% config text on the terminal, and paths under an unknown user's home


def test_check_escapes_control_characters_from_the_config_in_its_messages(tmp_path, capsys, monkeypatch):
    """A YAML string may hold ESC ("\\e"): an OSC or CSI sequence from the config must reach the
    terminal escaped, as every log tool prints text from outside, the wrapping unchanged."""
    rc, out = _check(capsys, monkeypatch, 'roomlog:\n  dir: "/proc/x\\e]0;PWNED\\a\\e[31mRED"\n', tmp_path)
    assert rc == 2, out.out + out.err
    assert "\x1b" not in out.err and "\x07" not in out.err
    assert "roomlog.dir: /proc/x\\x1b]0;PWNED\\x07\\x1b[31mRED cannot be created" in " ".join(out.err.split())
    assert out.err.startswith("dsv4-idxk-probe check: ") and _wide(out.err) == []


def test_check_names_a_room_log_dir_under_the_home_of_an_unknown_user(tmp_path, capsys, monkeypatch):
    """pathlib raises RuntimeError for ~user of no such user: an invalid config (exit 2), not exit 3."""
    rc, out = _check(capsys, monkeypatch, "roomlog:\n  dir: ~dsv4-no-such-user-zz/logs\n", tmp_path)
    assert rc == 2, out.out + out.err
    said = " ".join(out.err.split())  # as read, across the wrapped lines
    assert "probe.yaml: roomlog.dir: '~dsv4-no-such-user-zz/logs' starts with a '~'" in said
    assert "internal error" not in said


def test_the_log_dir_check_names_a_dir_under_the_home_of_an_unknown_user():
    """`examine` expands ~ itself (a config not read from a file keeps roomlog.dir as written)."""
    from dsv4_idxk_probe.cli.logdir import examine
    from dsv4_idxk_probe.config import parse_config

    verdict = examine(parse_config({"roomlog": {"dir": "~dsv4-no-such-user-zz/logs"}}))
    assert verdict.problem is not None and "'~dsv4-no-such-user-zz/logs'" in verdict.problem


def test_check_escapes_control_characters_in_a_target_table_s_names(tmp_path, capsys, monkeypatch):
    """A target table is the user's file too: a name holding ESC reaches the terminal escaped."""
    table = tmp_path / "targets.yaml"
    table.write_text('targets:\n  - name: "x.send\\e[31mRED"\n    module: sglang.srt.disaggregation.common.conn\n'
                     '    qualname: CommonKVSender.send\n    params: [self, kv_indices]\n    kind: before\n'
                     '    hook: "dsv4_idxk_probe.sglang.pd_prefill:make_sender_send_wrapper"\n'
                     '    required: false\n    role: prefill\n')
    for name in ("DSV4_IDXK_PROBE_CONFIG", "DSV4_IDXK_PROBE_EXCHANGE_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    check.main(argparse.Namespace(targets=[str(table)], json=False))
    out = capsys.readouterr()
    assert "x.send\\x1b[31mRED" in out.out, out.out + out.err
    assert "\x1b" not in out.out + out.err
