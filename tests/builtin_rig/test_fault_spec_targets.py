"""Resolving a fault against one room of one model: a target the model does not have is a
reason (the fault is then recorded "not applied"), never an exception and never a target
that changes nothing while it is recorded as applied."""

from __future__ import annotations

import numpy as np
import pytest

from dsv4_idxk_probe.digest import get_layout
from dsv4_idxk_probe.testbed.faults.inject import Target, resolve, rng_for
from dsv4_idxk_probe.testbed.faults.plan import RoomPlan
from dsv4_idxk_probe.testbed.faults.spec import parse_fault_spec

FP8 = get_layout("fp8")
ROOM = RoomPlan(room=1, prompt_tokens=700, prefix_pages=0, steps=10)  # 3 pages


def _resolve(body: str, layer_ids=(1, 3), plan=ROOM):
    fault = parse_fault_spec("faults:\n" + body, "spec.yaml").faults[0]
    return resolve(fault, plan, FP8, list(layer_ids), rng_for(0, fault, plan.room))


@pytest.mark.parametrize("body, reason", [
    ("  - {room: 1, when: in_flight, kind: bitflip, where: {layer: 2}}\n",
     "layer 2 is not a C4 layer of this model (C4 layers [1, 3])"),
    ("  - {room: 1, when: after_recv, kind: zero_page, where: {layer: 0}}\n", "layer 0 is not a C4 layer"),
    ("  - {room: 1, when: in_flight, kind: byte_set, where: {segment: scale, offset: 256}}\n",
     "offset 256 is outside segment 'scale' (256 bytes)"),
    ("  - {room: 1, when: in_flight, kind: byte_set, where: {offset: 300}}\n",
     "offset 300 is outside the shortest segment (256 bytes)"),
    ("  - {room: 1, when: in_flight, kind: bitflip, where: {segment: payload, range: [8190, 8200]}}\n",
     "range end 8200 is outside segment 'payload' (8192 bytes)"),
    ("  - {room: 1, when: in_flight, kind: bitflip, where: {segment: keys}}\n", "'keys' is not a segment of layout 'fp8'"),
    ("  - {room: 1, when: in_flight, kind: partial_write, keep_bytes: 9000}\n",
     "keep_bytes 9000 is not below the row size 8448"),
    ("  - {room: 1, when: in_flight, kind: zero_page, where: {page: 3}}\n",
     "room transfers only 3 pages (logical page 3 requested)"),
])
def test_a_target_the_model_or_the_room_does_not_have_is_a_reason(body, reason):
    got = _resolve(body)
    assert isinstance(got, str) and reason in got, got


def test_a_room_with_no_transferred_page_is_a_reason():
    got = _resolve("  - {room: 1, when: in_flight, kind: zero_page, where: {page: last}}\n",
                   plan=RoomPlan(room=1, prompt_tokens=512, prefix_pages=2, steps=1))
    assert isinstance(got, str), got


def test_targets_inside_the_model_resolve_as_before():
    target = _resolve("  - {room: 1, when: in_flight, kind: byte_set, value: 9, where: {layer: 3, page: 1, "
                      "segment: scale, offset: 255}}\n")
    assert isinstance(target, Target)
    assert (target.layers, target.layer_ids, target.page, target.segment) == ([1], [3], 1, "scale")
    assert (target.start, target.end) == (64 * 128 + 255, 64 * 128 + 256)
    same = [_resolve("  - {room: 1, when: in_flight, kind: bitflip}\n").describe() for _ in range(2)]
    assert same[0] == same[1] and np.isin(same[0]["layers"], [1, 3]).all()
