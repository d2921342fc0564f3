"""Fault specs an adversarial operator would write (issue 17): named errors, never a traceback."""

from __future__ import annotations

import pytest

from dsv4_idxk_probe.cli.main import run
from dsv4_idxk_probe.testbed.faults.spec import FaultSpecError, load_fault_spec, parse_fault_spec


def test_duplicate_rooms_are_refused_with_their_line():
    text = "faults:\n  - room: [2, 2, 2]\n    when: in_flight\n    kind: bitflip\n"
    with pytest.raises(FaultSpecError, match=r"<faults>:2: faults\[0\].room\[1\]: room 2 is listed more than once"):
        parse_fault_spec(text)


def test_a_binary_fault_spec_is_a_named_error(tmp_path):
    path = tmp_path / "faults.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    with pytest.raises(FaultSpecError, match=f"{path}: fault spec is not UTF-8 text"):
        load_fault_spec(path)


def test_a_binary_fault_spec_makes_the_demo_exit_2_with_the_prefix(tmp_path, capsys):
    path = tmp_path / "faults.yaml"
    path.write_bytes(b"\xff\xfe\x00binary")
    assert run(["demo", "--rooms", "5", "--faults", str(path), "--log-dir", str(tmp_path / "logs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4-idxk-probe demo: ") and "not UTF-8" in err and "Traceback" not in err


@pytest.mark.parametrize("path", ["/dev/zero"])
def test_a_device_is_refused_by_type(path):
    with pytest.raises(FaultSpecError, match="not a regular file"):
        load_fault_spec(path)


@pytest.mark.parametrize("text, message", [
    ("faults:\n  - {room: 100000000000000, when: in_flight, kind: bitflip}\n", "faults[0].room: must be <= 1_099_511_627_776"),
    ("faults:\n  - {room: 1, when: {after_step: 10000000000000}, kind: bitflip}\n", "when.after_step: must be <="),
    ("faults:\n  - {room: .inf, when: in_flight, kind: bitflip}\n", "a fraction of rooms must be in (0, 1]"),
    ("faults:\n  - {room: .nan, when: in_flight, kind: bitflip}\n", "a fraction of rooms must be in (0, 1]"),
    ("faults:\n  - {1: x, room: 1, when: in_flight, kind: bitflip}\n", "faults[0].1: unknown field"),
    ("faults:\n  - {room: 1, when: [in_flight], kind: [bitflip]}\n", "kind: ['bitflip'] is not one of"),
    ("faults: " + "[" * 3000 + "]" * 3000 + "\n", "not valid YAML: nested too deeply"),
])
def test_hostile_values_are_named(text, message):
    with pytest.raises(FaultSpecError) as info:
        parse_fault_spec(text)
    assert message in str(info.value)
