"""A decode pool small enough that SGLang retracts running rooms; on DeepSeek-V4 a
retracted room is rebootstrapped: prefill sends it again, same room, attempt 0,
with the generated tokens added (finding 3: `diff` must see one room)."""

from __future__ import annotations

import json

from dsv4_idxk_probe.testbed.sglang import launch, workload

from .conftest import decode_records, describe, pair_fixture

# decode admits rooms on a low estimate of their growth (a small reservation, a low
# conservativeness), so the running rooms outgrow the pool and SGLang retracts one
OPTIONS = launch.ServerOptions(max_total_tokens=8192, extra_decode=(
    "--num-reserved-decode-tokens", "16", "--schedule-conservativeness", "0.05"))


rig = pair_fixture("sglang-retraction", OPTIONS)


def test_a_rebootstrapped_room_is_one_room_whose_transfers_all_match(rig):
    """Whether SGLang retracts depends on how many rooms decode admitted before they grew;
    phases are sent until one retracted a room (three at most)."""
    for attempt in range(3):
        requests = workload.plan(f"retract{attempt}", workload.WorkloadOptions(
            rooms=16, seed=7 + attempt, min_prompt=1500, min_new_tokens=300, max_new_tokens=450))
        phase = rig.phase(f"retract{attempt}", requests, concurrency=8, settle_s=120.0)
        assert phase.ok, describe(phase)
        rooms = set(phase.rooms.values())
        retracted = [r for r in decode_records(rig) if int(r["room"]) in rooms and r.get("reason") == "retracted"]
        if retracted:
            break
    assert retracted, "no room was retracted in three phases: the pool is not small enough to exercise rebootstrap"
    doc = json.loads(phase.verification.diff_json.read_text())
    sent_twice = [r for r in doc["rooms"] if int(r["room"]) in rooms and len(r.get("transfers", [])) > 1]
    assert sent_twice, "no room was sent again after its retraction"
    for room in sent_twice:
        assert room["verdict"] == "match" and room["transfers"][1] > room["transfers"][0], room
        assert any(s["stage"] == "decode_finish" and s.get("transfer") == 1 and s["verdict"] == "match"
                   for s in room["stages"]), room
    summary = doc["summary"]
    assert (summary["conflicting_prefill_records"], summary["live_verdict_disagreements"]) == (0, 0), summary
    assert phase.verification.verdicts == {"match": 16}, describe(phase)
