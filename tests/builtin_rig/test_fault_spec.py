"""Fault specs: good ones parse, bad ones are refused with the file, line and field."""

from __future__ import annotations

import pytest

from dsv4_idxk_probe.digest import get_layout
from dsv4_idxk_probe.testbed.faults.spec import FaultSpecError, check_against, load_fault_spec, parse_fault_spec
from dsv4_idxk_probe.testbed.builtin.config import explicit_plan

PLAN = explicit_plan([(1, 700, 0, 10), (2, 300, 0, 5), (3, 1000, 2, 20), (4, 64, 0, 0)])
FP8 = get_layout("fp8")


def _one(body: str):
    return parse_fault_spec("faults:\n" + body, "spec.yaml").faults[0]


def test_full_entry_parses_every_field():
    f = _one(
        "  - name: x\n    room: [1, 3]\n    when: {after_step: 7}\n    kind: byte_set\n"
        "    where: {layer: 2, page: last, segment: scale, range: [4, 12]}\n    value: 9\n"
    )
    assert (f.room_ids, f.when, f.after_step, f.kind) == ((1, 3), "after_step", 7, "byte_set")
    assert (f.layer, f.page, f.segment, f.byte_range, f.value, f.side) == (2, "last", "scale", (4, 12), 9, "decode")


def test_defaults_are_random_and_sides_follow_timing():
    f = _one("  - {room: 0.5, when: before_send, kind: bitflip}\n")
    assert (f.room_fraction, f.layer, f.page, f.segment, f.offset, f.bit) == (0.5, "random", "random", "random", "random", "random")
    assert f.side == "prefill"
    assert _one("  - {room: 1, when: in_flight, kind: drop_page}\n").side == "prefill"
    assert _one("  - {room: 1, when: in_flight, kind: zero_page}\n").side == "decode"


@pytest.mark.parametrize(
    "body, field, line",
    [
        ("  - {room: 1, when: in_flight, kind: bitflop}\n", "faults[0].kind", 2),
        ("  - {room: 1, when: sometime, kind: bitflip}\n", "faults[0].when", 2),
        ("  - room: 1\n    when: {after_step: 0}\n    kind: bitflip\n", "faults[0].when.after_step", 3),
        ("  - {room: 1, when: after_recv, kind: drop_page}\n", "faults[0].when", 2),
        ("  - {room: 1, when: before_send, kind: swap_pages}\n", "faults[0].when", 2),
        ("  - room: 1\n    when: in_host_pool\n    kind: stale_page\n", "faults[0].kind", 4),
        ("  - {room: 1, when: in_host_pool, kind: drop_page}\n", "faults[0].kind", 2),
        ("  - {room: 1.5, when: in_flight, kind: bitflip}\n", "faults[0].room", 2),
        ("  - {room: [], when: in_flight, kind: bitflip}\n", "faults[0].room", 2),
        ("  - {room: [1, x], when: in_flight, kind: bitflip}\n", "faults[0].room[1]", 2),
        ("  - {when: in_flight, kind: bitflip}\n", "faults[0].room", 2),
        ("  - {room: 1, when: in_flight, kind: bitflip, colour: red}\n", "faults[0].colour", 2),
        ("  - room: 1\n    when: in_flight\n    kind: zero_page\n    where: {segment: scale}\n", "faults[0].where.segment", 5),
        ("  - {room: 1, when: in_flight, kind: bitflip, where: {offset: 3, range: [0, 4]}}\n", "faults[0].where.range", 2),
        ("  - {room: 1, when: in_flight, kind: bitflip, where: {range: [8, 4]}}\n", "faults[0].where.range", 2),
        ("  - {room: 1, when: in_flight, kind: bitflip, bit: 8}\n", "faults[0].bit", 2),
        ("  - {room: 1, when: in_flight, kind: bitflip, value: 3}\n", "faults[0].value", 2),
        ("  - {room: 1, when: in_flight, kind: byte_set, where: {layer: -1}}\n", "faults[0].where.layer", 2),
        ("  - ok\n", "faults[0]", 2),
    ],
)
def test_bad_field_is_named_with_its_line(body, field, line):
    with pytest.raises(FaultSpecError) as err:
        parse_fault_spec("faults:\n" + body, "spec.yaml")
    message = str(err.value)
    assert message.startswith(f"spec.yaml:{line}: {field}:"), message


def test_a_host_pool_fault_is_applied_by_prefill_and_refused_by_the_built_in_rig():
    f = _one("  - {room: 1, when: in_host_pool, kind: byte_set, where: {segment: payload}}\n")
    assert (f.when, f.kind, f.side, f.label) == ("in_host_pool", "byte_set", "prefill", "#0 fault-0 (byte_set @ in_host_pool)")
    assert _one("  - {room: 1, when: in_host_pool, kind: zero_page}\n").side == "prefill"
    spec = parse_fault_spec("faults:\n  - {room: 1, when: in_host_pool, kind: bitflip}\n", "spec.yaml")
    with pytest.raises(FaultSpecError, match=r"^spec.yaml: faults\[0\].when: in_host_pool needs SGLang's HiCache host pools"):
        check_against(spec, FP8, [0, 2, 4], PLAN)


def test_garbage_documents_are_refused(tmp_path):
    with pytest.raises(FaultSpecError, match="not valid YAML"):
        parse_fault_spec("faults: [", "spec.yaml")
    with pytest.raises(FaultSpecError, match="top level must be a mapping"):
        parse_fault_spec("- just a list", "spec.yaml")
    with pytest.raises(FaultSpecError, match="faults: must be a list"):
        parse_fault_spec("faults: 3", "spec.yaml")
    with pytest.raises(FaultSpecError, match="cannot read fault spec"):
        load_fault_spec(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    "body, message",
    [
        ("  - {room: 9, when: in_flight, kind: bitflip}\n", r"faults\[0\].room: room 9 is not in this run"),
        ("  - {room: 1, when: in_flight, kind: bitflip, where: {layer: 1}}\n", r"where.layer: 1 is not a C4 layer id"),
        ("  - {room: 1, when: in_flight, kind: bitflip, where: {segment: keys}}\n", r"'keys' is not a segment of layout 'fp8'"),
        ("  - {room: 1, when: in_flight, kind: bitflip, where: {segment: scale, offset: 256}}\n", r"offset: 256 is outside"),
        ("  - {room: 1, when: in_flight, kind: partial_write, keep_bytes: 8448}\n", r"keep_bytes: must be below the row size"),
        ("  - {room: 1, when: after_recv, kind: swap_pages, with_room: 7}\n", r"with_room: room 7 is not in this run"),
    ],
)
def test_references_the_run_cannot_satisfy_are_refused(body, message):
    spec = parse_fault_spec("faults:\n" + body, "spec.yaml")
    with pytest.raises(FaultSpecError, match=message):
        check_against(spec, FP8, [0, 2, 4], PLAN)


def test_fractions_pick_the_same_rooms_everywhere_and_differ_by_seed():
    spec = parse_fault_spec("faults:\n  - {room: 0.5, when: in_flight, kind: bitflip}\n")
    fault = spec.faults[0]
    first = spec.rooms_for(fault, PLAN, seed=3)
    assert len(first) == 2 and set(first) <= {1, 2, 3, 4}
    assert spec.rooms_for(fault, PLAN, seed=3) == first
    picks = {tuple(spec.rooms_for(fault, PLAN, seed=s)) for s in range(20)}
    assert len(picks) > 1


def test_by_room_splits_faults_between_the_sides():
    spec = parse_fault_spec(
        "faults:\n"
        "  - {room: 1, when: before_send, kind: bitflip}\n"
        "  - {room: [1, 2], when: in_flight, kind: partial_write}\n"
        "  - {room: 2, when: after_recv, kind: zero_page}\n"
    )
    prefill = spec.by_room(PLAN, 0, side="prefill")
    decode = spec.by_room(PLAN, 0, side="decode")
    assert {room: [f.index for f in fs] for room, fs in prefill.items()} == {1: [0, 1], 2: [1]}
    assert {room: [f.index for f in fs] for room, fs in decode.items()} == {2: [2]}


def test_the_shipped_demo_spec_is_valid_for_the_demo_defaults():
    from dsv4_idxk_probe.testbed.faults.summary import shipped_fault_spec
    from dsv4_idxk_probe.testbed.builtin.config import RigConfig

    cfg = RigConfig().validated()
    spec = load_fault_spec(shipped_fault_spec())
    check_against(spec, FP8, cfg.layer_ids, cfg.room_plan())
    kinds = {f.kind for f in spec.faults}
    whens = {f.when for f in spec.faults}
    assert kinds == {"bitflip", "byte_set", "zero_page", "swap_pages", "stale_page", "partial_write", "drop_page"}
    assert whens == {"before_send", "in_flight", "after_recv", "after_step"}
