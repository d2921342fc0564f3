"""A decode pool small enough that SGLang retracts running rooms; on DeepSeek-V4 a
retracted room is rebootstrapped: prefill sends it again, same room, attempt 0,
with the generated tokens added (finding 3: `diff` must see one room).

Every room has one page zeroed as its transfer lands (an `in_flight` fault on layer 1,
page 0), so a rebootstrapped room has it twice, once per transfer: the rig expects each
at its own transfer's `decode_recv`, and the probe must report both."""

from __future__ import annotations

import json

from dsv4_idxk_probe.testbed.sglang import launch, workload

from .conftest import decode_records, describe, pair_fixture

# decode admits rooms on a low estimate of their growth (a small reservation, a low
# conservativeness), so the running rooms outgrow the pool and SGLang retracts one
OPTIONS = launch.ServerOptions(max_total_tokens=8192, extra_decode=(
    "--num-reserved-decode-tokens", "16", "--schedule-conservativeness", "0.05"))


rig = pair_fixture("sglang-retraction", OPTIONS)

LANDING_FAULT = """faults:
  - name: page-zeroed-as-it-lands
    room: 1.0
    when: in_flight
    kind: zero_page
    where: {layer: 1, page: 0}
"""


def test_a_rebootstrapped_room_is_one_room_each_of_whose_transfers_is_judged_on_its_own(rig, tmp_path):
    """Whether SGLang retracts depends on how many rooms decode admitted before they grew;
    phases are sent until one retracted a room (three at most)."""
    spec = tmp_path / "landing.yaml"
    spec.write_text(LANDING_FAULT)
    for attempt in range(3):
        requests = workload.plan(f"retract{attempt}", workload.WorkloadOptions(
            rooms=16, seed=7 + attempt, min_prompt=1500, min_new_tokens=300, max_new_tokens=450))
        phase = rig.phase(f"retract{attempt}", requests, concurrency=8, settle_s=120.0, faults=str(spec))
        assert phase.ok, describe(phase)
        rooms = set(phase.rooms.values())
        retracted = [r for r in decode_records(rig) if int(r["room"]) in rooms and r.get("reason") == "retracted"]
        if retracted:
            break
    assert retracted, "no room was retracted in three phases: the pool is not small enough to exercise rebootstrap"
    doc = json.loads(phase.verification.diff_json.read_text())
    sent_twice = [r for r in doc["rooms"] if int(r["room"]) in rooms and len(r.get("transfers", [])) > 1]
    assert sent_twice, "no room was sent again after its retraction"
    by_room: dict[int, list] = {}
    for check in phase.verification.checks:  # one per (fault, room, transfer), each found where expected
        by_room.setdefault(check.record["room"], []).append(check)
    for room in sent_twice:
        assert room["verdict"] == "mismatch" and room["transfers"][1] > room["transfers"][0], room
        for transfer in (0, 1):  # the zeroed page, reported at each transfer's receipt, localised to it
            (recv,) = [s for s in room["stages"] if s["stage"] == "decode_recv" and (s.get("transfer") or 0) == transfer]
            assert recv["verdict"] == "mismatch" and recv["localisation"]["pages"] == [0], room
        checks = by_room[int(room["room"])]
        assert sorted(c.record["transfer"] for c in checks) == [0, 1], [c.record for c in checks]
        assert all(c.ok and c.record["applied"] for c in checks), [c.note for c in checks]
        assert {(c.record["transfer"], e["transfer"], e["stage"]) for c in checks for e in c.expected} == {
            (0, 0, "decode_recv"), (1, 1, "decode_recv")}, [c.expected for c in checks]
    summary = doc["summary"]
    assert (summary["conflicting_prefill_records"], summary["live_verdict_disagreements"]) == (0, 0), summary
    assert phase.verification.verdicts == {"mismatch": 16}, describe(phase)
