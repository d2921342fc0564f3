"""Fault specs an adversarial operator would write: named errors, never a traceback."""

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


# %% reliability round two: the spec is read by the one safe YAML loader (dsv4_idxk_probe/safeyaml.py)


def alias_bomb(levels: int = 9) -> str:
    """'Billion laughs': 9 anchors, each a list of 9 aliases of the one before (9**9 strings once followed)."""
    parts = ["&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    parts += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


def test_an_alias_bomb_is_refused_at_once():
    import time

    text = f"faults:\n  - {{when: in_flight, kind: bitflip, room: {alias_bomb()}}}\n"
    assert len(text) < 520
    start = time.perf_counter()
    with pytest.raises(FaultSpecError, match=r"^<faults>:2: YAML anchors and aliases are not accepted \(&a0\)"):
        parse_fault_spec(text)
    assert time.perf_counter() - start < 1.0


def test_an_alias_bomb_file_is_refused_by_the_demo_with_exit_2(tmp_path, capsys):
    path = tmp_path / "faults.yaml"
    path.write_text(f"faults:\n  - {{when: in_flight, kind: bitflip, room: {alias_bomb()}}}\n")
    assert run(["demo", "--rooms", "5", "--faults", str(path), "--log-dir", str(tmp_path / "logs")]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: YAML anchors and aliases are not accepted" in err and len(err) < 300


def test_a_key_given_twice_is_refused_with_both_lines():
    text = "faults:\n  - room: 1\n    when: in_flight\n    kind: bitflip\n    room: 2\n"
    with pytest.raises(FaultSpecError,
                       match=r"^<faults>:5: key 'room' is given twice in one mapping \(first at line 2\)"):
        parse_fault_spec(text)


@pytest.mark.parametrize("text, message", [
    ("faults:\n  - {room: " + "1" * 5000 + ", when: in_flight, kind: bitflip}\n",
     "<faults>:2: a number of 5,000 characters is out of range"),
    ("faults:\n  - {room: 1, when: in_flight, kind: " + "x" * 100_000 + "}\n", "kind: 'xxx"),
    ("faults:\n  - {room: [" + "7, " * 20 + "x], when: in_flight, kind: bitflip}\n",
     "room[20]: must be an integer, got 'x'"),
    ("faults:\n  - {room: 1, when: 2001-13-45, kind: bitflip}\n", "<faults>:2: cannot read '2001-13-45'"),
    ("faults: [" + "1, " * 330_000 + "]\n", "the document has more than 320,000 nodes"),
])
def test_hostile_yaml_is_named_and_short(text, message):
    with pytest.raises(FaultSpecError) as info:
        parse_fault_spec(text)
    assert message in str(info.value) and len(str(info.value)) < 300, str(info.value)[:400]
