"""When things go wrong around the probe: a dead decode, an unreachable exchange,
bad input, a failing child, and the probe switched off."""

from __future__ import annotations

import time

import pytest
import yaml
from tests.support.rigutil import diff_rooms, dump, free_port, run, write_faults, write_probe_config

from dsv4_idxk_probe.cli.main import run as cli
from dsv4_idxk_probe.config import ConfigError
from dsv4_idxk_probe.roomlog import expand_inputs, read_entries
from dsv4_idxk_probe.testbed.faults.spec import FaultSpecError
from dsv4_idxk_probe.testbed.builtin.config import RigConfig, RoleEnv
from dsv4_idxk_probe.testbed.builtin.rig import RigError, run_rig
from dsv4_idxk_probe.testbed.builtin.settings import child_env
from dsv4_idxk_probe.testbed.faults.verify import verify

SMALL = dict(layers=2, min_tokens=100, max_tokens=800, chunk_tokens=256, min_steps=20, max_steps=40, pool_source="builtin")


def test_decode_killed_mid_run(tmp_path):
    cfg = RigConfig(rooms=40, max_running=8, **SMALL)
    result = run(tmp_path, cfg, kill_decode_after=10)
    assert result.decode_killed and 10 <= len(result.finished) < 40
    # prefill kept serving: it answered, and its exchange still hands out a sent room's vectors
    after = result.prefill_after_kill
    assert after["pong"] is not None and after["pong"]["decode_gone"] is True, dump(after)
    assert after["lookup"]["digest"] is not None and after["lookup"]["digest"]["key"] == f"{after['lookup']['room']}/0"
    assert "prefill" in result.stats  # and it shut down cleanly when told to
    # every log line that was written whole is readable; at most decode's last line is torn
    entries = list(read_entries(expand_inputs([str(tmp_path / "logs")])))
    bad = [e for e in entries if e.record is None]
    assert len(bad) <= 1 and all("decode" in e.file for e in bad), dump([e.where + " " + str(e.error) for e in bad])
    status, doc, rooms = diff_rooms(tmp_path / "logs")
    assert status in (0, 2), dump(doc["summary"])  # no mismatch; 2 only for a torn last line
    # rooms decode never finished are reported unverified, never as verified
    check = verify(tmp_path / "logs", result.faults, result.oracle, [p.room for p in cfg.room_plan()])
    planned = {p.room for p in cfg.room_plan()}
    with_finish = {room for room, r in rooms.items() if any(s["stage"] == "decode_finish" for s in r["stages"])}
    assert set(check.unfinished) == planned - with_finish
    # killed mid-batch: a room's finish line can reach the disk while its event dies in the
    # process's queue, or the other way round; at most one decode batch is in that window
    assert len(with_finish - result.finished) <= cfg.max_running
    assert planned - result.finished - with_finish <= set(check.unfinished)
    assert all(r["verdict"] == "match" for r in rooms.values())  # what was checked before the crash was fine


def test_unreachable_exchange_peer_gives_unverified_without_a_hang(tmp_path):
    """Prefill runs without the probe (no in-band digest), so decode must ask an exchange nobody serves."""
    cfg = RigConfig(rooms=12, exchange_address=f"127.0.0.1:{free_port()}", **SMALL)
    started = time.monotonic()
    result = run(tmp_path, cfg, prefill_probe=False, config_sections={"exchange": {"timeout_ms": 300, "backoff_s": 0.5}})
    assert time.monotonic() - started < 90
    assert len(result.finished) == 12
    _, doc, rooms = diff_rooms(tmp_path / "logs")
    verdicts = {s["verdict"] for r in rooms.values() for s in r["stages"]}
    assert verdicts == {"unverified"}, dump(doc["summary"])
    assert doc["summary"]["room_verdicts"] == {"unverified": 12}


def test_probe_off_means_no_probe_at_all(tmp_path):
    """Without DSV4_IDXK_PROBE the rig still moves and checks every room, and the probe writes nothing."""
    cfg = RigConfig(rooms=10, **SMALL)
    result = run(tmp_path, cfg, prefill_probe=False, decode_probe=False)
    assert len(result.finished) == 10 and result.info["prefill"]["probe"] is False
    assert not (tmp_path / "logs").exists()
    assert all(not o["cells"] for o in result.oracle) and len(result.oracle) > 10


def test_garbage_fault_spec_is_refused_before_anything_starts(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("faults:\n  - room: 1\n    when: in_flight\n    kind: bitflop\n")
    env = RoleEnv(common=child_env(config=str(write_probe_config(tmp_path)), faults=str(bad)))
    with pytest.raises(FaultSpecError, match=r"bad.yaml:4: faults\[0\].kind: 'bitflop' is not one of"):
        run_rig(RigConfig(rooms=3, **SMALL), env, timeout_s=30)
    assert cli(["demo", "--rig", "builtin", "--rooms", "20", "--faults", str(bad), "--log-dir", str(tmp_path / "demo")]) == 2
    assert "faults[0].kind" in capsys.readouterr().err


def test_fault_room_outside_the_run_is_refused(tmp_path, capsys):
    spec = write_faults(tmp_path, [{"room": 99, "when": "in_flight", "kind": "bitflip"}])
    assert cli(["demo", "--rig", "builtin", "--rooms", "5", "--faults", str(spec), "--log-dir", str(tmp_path / "demo")]) == 2
    assert "faults[0].room: room 99 is not in this run" in capsys.readouterr().err


@pytest.mark.parametrize(
    "document, message",
    [
        ("step_interval: often\n", "step_interval must be an integer"),
        ("exchange: {timeout_ms: fast}\n", "exchange.timeout_ms must be an integer"),
        ("mode: [\n", "not valid YAML"),
        ("colour: red\n", "unknown key"),
    ],
)
def test_garbage_probe_config_is_refused_with_file_and_field(tmp_path, capsys, document, message):
    config = tmp_path / "probe.yaml"
    config.write_text(document)
    env = RoleEnv(common=child_env(config=str(config)))
    with pytest.raises(ConfigError, match=message) as err:
        run_rig(RigConfig(rooms=3, **SMALL), env, timeout_s=30)
    assert str(config) in str(err.value)
    assert cli(["demo", "--rig", "builtin", "--rooms", "20", "--probe-config", str(config), "--log-dir", str(tmp_path / "demo")]) == 2
    assert message in capsys.readouterr().err


def test_fault_injection_is_refused_in_enforce_mode(tmp_path):
    config = write_probe_config(tmp_path)
    faults = write_faults(tmp_path, [{"room": 1, "when": "in_flight", "kind": "bitflip"}])
    env = RoleEnv(common=child_env(probe="enforce", config=str(config), faults=str(faults)))
    with pytest.raises(ConfigError, match="cannot be combined with enforce"):
        run_rig(RigConfig(rooms=3, **SMALL), env, timeout_s=30)
    config.write_text(yaml.safe_dump({"mode": "enforce"}))
    with pytest.raises(ConfigError, match="cannot be combined with enforce"):
        run_rig(RigConfig(rooms=3, **SMALL), RoleEnv(common=child_env(config=str(config), faults=str(faults))), timeout_s=30)


def test_a_failing_child_reaches_the_parent_with_its_reason(tmp_path):
    cfg = RigConfig(rooms=3, **{**SMALL, "pool_source": "sglang"}, layout="bf16")
    started = time.monotonic()
    with pytest.raises(RigError, match=r"(?s)(prefill|decode) failed: .*no 'bf16' layout"):
        run(tmp_path, cfg)
    assert time.monotonic() - started < 60
