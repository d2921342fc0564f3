"""The SGLang rig's fault machinery without servers: a test bed that cannot pass by accident.

Every planned fault ends in a record, applied or "not applied" with the reason; a spec the
model cannot satisfy is refused by the driver before any request is sent; nothing the
injector meets inside a server raises into SGLang; and a fault applied again to a
retracted room's second transfer is expected at that transfer (docs/faults.md, docs/rig.md).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dsv4_idxk_probe.testbed.faults.spec import FaultSpecError
from dsv4_idxk_probe.testbed.sglang import hooks, launch, run
from dsv4_idxk_probe.testbed.sglang.injector import Injector
from dsv4_idxk_probe.testbed.sglang.oracle import Oracle
from dsv4_idxk_probe.testbed.sglang.output import Out
from dsv4_idxk_probe.testbed.sglang.plan import PlanFile
from dsv4_idxk_probe.testbed.sglang.rooms import Rooms, Track
from dsv4_idxk_probe.testbed.sglang.workload import Request

C4_LAYERS = [1, 3]  # the rig model's (launch.MODEL_CONFIG): layers 0 and 2 are not C4 layers
ROW = 8448  # fp8 index-K row


def requests(*numbers: int, tokens: int = 700, steps: int = 10) -> list[Request]:
    return [Request(n, f"t-{n}", tuple(range(2, 2 + tokens)), steps) for n in numbers]


def spec_file(tmp_path, body: str):
    path = tmp_path / "faults.yaml"
    path.write_text("faults:\n" + body)
    return path


def test_the_rigs_model_has_c4_layers_1_and_3():
    assert launch.c4_layer_ids() == C4_LAYERS


# %% the driver refuses what the model or the phase cannot take, before any request is sent


@pytest.mark.parametrize("body, message", [
    ("  - {room: 1, when: in_flight, kind: bitflip, where: {layer: 2}}\n",
     r"faults\[0\].where.layer: 2 is not a C4 layer id of this phase \(\[1, 3\]\)"),
    ("  - {room: 1, when: after_recv, kind: zero_page, where: {layer: 0}}\n", r"where.layer: 0 is not a C4 layer id"),
    ("  - {room: 1, when: in_flight, kind: byte_set, where: {segment: scale, offset: 300}}\n",
     r"where.offset: 300 is outside the segment \(256 bytes\)"),
    ("  - {room: 1, when: in_flight, kind: bitflip, where: {segment: payload, range: [8000, 8193]}}\n",
     r"where.range: end 8193 is outside the segment \(8192 bytes\)"),
    ("  - {room: 1, when: in_flight, kind: bitflip, where: {segment: keys}}\n", r"'keys' is not a segment of layout 'fp8'"),
    ("  - {room: 1, when: in_flight, kind: partial_write, keep_bytes: 8448}\n", r"keep_bytes: must be below the row size"),
    ("  - {room: [1, 7], when: in_flight, kind: bitflip}\n", r"room: room 7 is not in this phase \(rooms 1, 2\)"),
    ("  - {room: 1, when: in_host_pool, kind: bitflip}\n", r"in_host_pool needs SGLang's HiCache on prefill"),
])
def test_the_driver_refuses_a_spec_the_model_or_the_phase_cannot_take_before_sending(tmp_path, monkeypatch, body, message):
    sent = []
    monkeypatch.setattr(run, "send", lambda *a, **k: sent.append(a) or [])
    session = run.RigSession(tmp_path / "run")
    session.cluster = SimpleNamespace(url="http://127.0.0.1:9")  # never reached
    plan_before = session.plan_path.read_text()
    with pytest.raises(FaultSpecError, match=message):
        session.phase("bad", requests(1, 2), faults=str(spec_file(tmp_path, body)))
    assert not sent, "a request was sent with a spec the model cannot take"
    assert session.plan_path.read_text() == plan_before, "the servers were handed the bad spec"


def test_the_driver_takes_the_shipped_spec_and_a_host_pool_fault_where_hicache_runs(tmp_path):
    from dsv4_idxk_probe.testbed.faults.summary import shipped_fault_spec

    spec = run.check_fault_spec(shipped_fault_spec(), requests(*range(1, 49)), launch.ServerOptions())
    assert len(spec.faults) == 12
    host = spec_file(tmp_path, "  - {room: 3, when: in_host_pool, kind: byte_set, where: {layer: 3}}\n")
    run.check_fault_spec(host, requests(3), launch.ServerOptions(prefill_hicache=True))


# %% inside the servers: an impossible target is "not applied", with the reason, never an exception


class Bed:
    """The in-server parts of a decode server over two C4 layers of 16 pages, without SGLang."""

    def __init__(self, tmp_path, body: str, numbers=(1,), seed: int = 0):
        spec = spec_file(tmp_path, body)
        self.rids = {f"t-{n}": n for n in numbers}
        plan = tmp_path / "plan.json"
        plan.write_text(json.dumps({"rooms": self.rids, "seed": seed, "faults": str(spec)}))
        self.out_dir = tmp_path / "rig"
        out = Out(self.out_dir, "decode")
        self.plan_file = PlanFile(str(plan))
        self.rooms = Rooms()
        self.rooms.buffers = [torch.zeros(16, ROW, dtype=torch.uint8) for _ in C4_LAYERS]
        self.rooms.layer_ids = list(C4_LAYERS)
        self.injector = Injector("decode", self.plan_file, self.rooms, out)
        self.rig = hooks._Rig("decode", self.plan_file, out, self.rooms, self.injector, Oracle(self.rooms, out))

    def track(self, number: int = 1, tokens: int = 700, room: int = 1000, pages=(4, 5, 6)) -> Track:
        track = Track(f"t-{number}", number, room + number, 0, tokens, list(pages))
        track.tokens = np.arange(2, 2 + tokens + 64, dtype=np.int64)
        track.before = {k: self.rooms.rows(p) for k, p in enumerate(track.pages)}
        track.req_pool_idx = number
        self.rooms.tracks[track.room] = track
        self.rooms.by_pool_idx[number] = track
        return track

    def records(self) -> list[dict]:
        out = []
        for path in sorted(self.out_dir.glob("*-faults.jsonl")):
            out += [json.loads(line) for line in path.read_text().splitlines()]
        return out

    def faults(self, rid: str, whens=hooks.DECODE_WHENS):
        return self.plan_file.faults_for(rid, whens)


@pytest.fixture
def armed(monkeypatch):
    def arm(bed: Bed) -> Bed:
        monkeypatch.setattr(hooks, "_rig", bed.rig)
        return bed
    return arm


def test_an_in_flight_fault_on_a_layer_that_is_not_c4_is_recorded_not_applied(tmp_path):
    bed = Bed(tmp_path, "  - {room: 1, when: in_flight, kind: bitflip, where: {layer: 2}}\n")
    track = bed.track()
    for fault in bed.faults(track.rid):
        bed.injector.apply(fault, track)
    (record,) = bed.records()
    assert (record["applied"], record["rid"]) == (False, "t-1")
    assert "layer 2 is not a C4 layer of this model (C4 layers [1, 3])" in record["reason"], record
    assert all(not buf.any() for buf in bed.rooms.buffers), "bytes changed by a fault recorded as not applied"


def test_an_offset_past_its_segment_is_recorded_not_applied_rather_than_applied_with_no_effect(tmp_path):
    bed = Bed(tmp_path, "  - {room: 1, when: in_flight, kind: byte_set, value: 7, where: {layer: 1, page: 0, "
                        "segment: scale, offset: 300}}\n")
    track = bed.track()
    (fault,) = bed.faults(track.rid)
    bed.injector.apply(fault, track)
    (record,) = bed.records()
    assert record["applied"] is False and "offset 300 is outside segment 'scale' (256 bytes)" in record["reason"], record


def test_after_recv_on_a_layer_that_is_not_c4_never_raises_into_the_decode_forward(tmp_path, armed):
    bed = armed(Bed(tmp_path, "  - {room: 1, when: after_recv, kind: zero_page, where: {layer: 2}}\n"))
    bed.track()
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True),
                            req_pool_indices=torch.tensor([1]))
    hooks._before_decode_forward(batch)  # SGLang's forward: a ValueError here took the decode scheduler down
    (record,) = bed.records()
    assert record["applied"] is False and "not a C4 layer" in record["reason"], record


def test_an_injector_failure_is_recorded_not_applied_and_never_raised(tmp_path, monkeypatch):
    bed = Bed(tmp_path, "  - {room: 1, when: in_flight, kind: zero_page}\n")
    track = bed.track()

    def boom(*_a, **_k):
        raise RuntimeError("row gone")

    monkeypatch.setattr("dsv4_idxk_probe.testbed.faults.inject.apply_in_place", boom)
    (fault,) = bed.faults(track.rid)
    bed.injector.apply(fault, track)
    (record,) = bed.records()
    assert record["applied"] is False and record["reason"] == "the injector failed: RuntimeError: row gone"


def test_a_fault_the_room_never_reaches_is_recorded_when_the_room_ends(tmp_path, armed):
    bed = armed(Bed(tmp_path, "  - {room: 1, when: {after_step: 40}, kind: zero_page}\n"
                              "  - {room: 1, when: {after_step: 3}, kind: zero_page, where: {layer: 1, page: 0}}\n"))
    track = bed.track()
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True), req_pool_indices=torch.tensor([1]))
    for _ in range(30):  # the room decodes 30 steps
        hooks._before_decode_forward(batch)
    req = SimpleNamespace(rid="t-1", bootstrap_room=track.room, finished=lambda: True)
    hooks._scribble(req)  # SGLang released the finished room's pages
    by_fault = {r["fault"]: r for r in bed.records()}
    assert by_fault[1]["applied"] is True
    assert (by_fault[0]["applied"], by_fault[0]["reason"]) == (False, "room ended at step 30")
    hooks._scribble(req)
    assert len(bed.records()) == 2, "a fault recorded twice"


# %% the driver: every planned fault has a record; each transfer of a retried room has its own


def test_a_planned_fault_of_an_answered_room_without_any_record_is_a_failure(tmp_path):
    path = spec_file(tmp_path, "  - {room: 1, when: {after_step: 40}, kind: zero_page}\n"
                               "  - {room: [1, 2], when: in_flight, kind: bitflip}\n")
    reqs = requests(1, 2)
    spec = run.check_fault_spec(path, reqs, launch.ServerOptions())
    owed = run.planned_faults(spec, reqs, 0, {"t-1", "t-2"})
    assert sorted(owed) == [(0, "t-1"), (1, "t-1"), (1, "t-2")]
    records = [{"fault": 1, "rid": "t-1"}, {"fault": 1, "rid": "t-2"},
               {"fault": 0, "rid": "t-2", "partner_of": "t-1"}]  # a partner's record accounts for nothing
    (line,) = run.unrecorded(owed, records)
    assert line.startswith("t-1: fault #0") and "left no record" in line
    assert not run.unrecorded(owed, records + [{"fault": 0, "rid": "t-1", "applied": False}])
    assert not run.unrecorded(run.planned_faults(spec, reqs, 0, {"t-2"}), records)  # t-1 not answered: owed nothing


def _oracle(room, transfer, n_tokens, points):
    return [{"room": room, "transfer": transfer, "n_tokens": n_tokens, "index": i, "stage": stage, "step": step,
             "cells": cells} for i, (stage, step, cells) in enumerate(points)]


def test_a_fault_applied_again_to_a_retracted_rooms_second_transfer_is_expected_at_that_transfer():
    cell = [1, 0, "payload"]
    oracle = (_oracle(7, 0, 2511, [("decode_recv", None, [cell]), ("decode_step", 4, [cell])])
              + _oracle(7, 1, 2790, [("decode_recv", None, [cell]), ("decode_finish", None, [cell])]))
    base = {"fault": 0, "name": "f", "kind": "zero_page", "when": "in_flight", "after_step": 0, "side": "decode",
            "rid": "r-1", "rig_room": 1, "room": 7, "applied": True, "cells": [cell], "point": 0}
    records = [dict(base, n_tokens=2511, transfer=0), dict(base, n_tokens=2790, transfer=1)]
    first, second = run.expectations(records, oracle)
    assert [e["tokens"] for e in first["effects"]] == [2511]
    assert [(e["stage"], e["tokens"]) for e in second["effects"]] == [("decode_recv", 2790)]
    assert (first["transfer"], second["transfer"]) == (0, 1)


def test_the_demo_refuses_a_spec_the_model_cannot_take_before_any_server_starts(tmp_path, monkeypatch):
    import io

    from dsv4_idxk_probe.testbed.sglang import demo

    def no_servers(*_a, **_k):
        raise AssertionError("a server was started with a spec the model cannot take")

    monkeypatch.setattr(launch, "start", no_servers)
    spec = spec_file(tmp_path, "  - {room: 3, when: after_recv, kind: zero_page, where: {layer: 2}}\n")
    options = demo.SGLangDemoOptions(rooms=8, faults=str(spec), log_dir=str(tmp_path / "logs"))
    with pytest.raises(FaultSpecError, match=r"where.layer: 2 is not a C4 layer id"):
        demo.run_sglang_demo(options, io.StringIO())
    spec = spec_file(tmp_path, "  - {room: 30, when: after_recv, kind: zero_page}\n")
    with pytest.raises(FaultSpecError, match=r"room 30 is not in this phase \(rooms 1..8\)"):
        demo.run_sglang_demo(demo.SGLangDemoOptions(rooms=8, faults=str(spec), log_dir=str(tmp_path / "logs")),
                             io.StringIO())


# %% the step digests the probe owed, whatever it recorded


def test_a_room_decoded_over_two_step_intervals_without_a_step_digest_is_named():
    """The oracle reads bytes only where the probe digests, so a probe that skipped its
    decode_step digests would move every fault to decode_finish unnoticed: a room with
    2 x interval decode batches or more (outputs less prefill's one) and no decode_step point
    is named; shorter rooms, aborted ones and rooms with one are not."""
    from dsv4_idxk_probe.testbed.sglang.workload import Outcome, Request

    def outcome(number, outputs, aborted=False):
        request = Request(number, f"t-{number}", (1, 2, 3), outputs, abort_after_s=1.0 if aborted else None)
        return Outcome(request, 200, list(range(outputs)))

    outcomes = [outcome(1, 9), outcome(2, 8), outcome(3, 40), outcome(4, 40, aborted=True), outcome(5, 12)]
    rooms = {f"t-{n}": 100 + n for n in range(1, 6)}
    # room 103: 39 decode batches, interval 4: owed 39 // 4 - 2 = 7 step digests
    oracle = [{"room": 103, "stage": "decode_step", "step": 4 * k} for k in range(1, 8)]
    oracle += [{"room": 105, "stage": "decode_recv"}, {"room": 101, "stage": "decode_finish"}]
    missing = run.missing_step_digests(outcomes, rooms, oracle, interval=4)
    assert [m.split(":")[0] for m in missing] == ["t-1", "t-5"]
    assert run.missing_step_digests(outcomes, rooms, oracle, interval=0) == []  # no step digests configured


def test_a_room_stepped_more_rarely_than_the_rule_is_named_unless_it_was_sent_again():
    """A probe that took its step digests at half its rule's rate moved faults to later stages
    unnoticed: a room sent once is owed B // interval - 2 of them (B: its decode batches). The
    same point reported twice (a V4.1 pair's pool monitors) counts once; a retracted room sent
    again is owed one only (its batches around the retraction are not known here)."""
    from dsv4_idxk_probe.testbed.sglang.workload import Outcome, Request

    outcomes = [Outcome(Request(n, f"t-{n}", (1, 2, 3), 41), 200, list(range(41))) for n in (1, 2)]
    rooms = {"t-1": 101, "t-2": 102}
    halved = [{"room": r, "stage": "decode_step", "step": 8 * k} for r in (101, 102) for k in range(1, 6)]
    halved += halved[:5]  # the same points again
    resent = [{"room": 102, "stage": "decode_recv", "transfer": 1}]
    missing = run.missing_step_digests(outcomes, rooms, halved + resent, interval=4)
    assert [m.split(":")[0] for m in missing] == ["t-1"] and "5 decode_step digest(s), 8 owed" in missing[0], missing
    full = [{"room": 101, "stage": "decode_step", "step": 4 * k} for k in range(1, 9)]
    assert run.missing_step_digests(outcomes[:1], {"t-1": 101}, full, interval=4) == []
