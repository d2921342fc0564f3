"""SGLang 0.5.23's prefill and decode servers with their normal event loops, NIXL
over UCX on loopback, the probe switched on by its environment variable only: the
test bed of record (docs/rig.md). Prefill's radix cache is on (SGLang's default), so
shared prompt prefixes are cache hits there and leave early as cached-prefix sends;
decode's radix cache cannot run with DeepSeek-V4 here (test_sglang_refusals.py)."""

from __future__ import annotations

import re
import threading
import time

from dsv4_idxk_probe.testbed.sglang import launch, workload
from dsv4_idxk_probe.testbed.sglang.workload import Request
from dsv4_idxk_probe.testbed.faults.summary import shipped_fault_spec

from .conftest import decode_records, describe, pair_fixture

OPTIONS = launch.ServerOptions()


rig = pair_fixture("sglang-normal", OPTIONS)


def test_500_clean_rooms_all_match_through_chunked_prefill_and_prefill_prefix_hits(rig):
    requests = workload.plan("clean", workload.WorkloadOptions(rooms=500, seed=2, max_new_tokens=24))
    phase = rig.phase("clean", requests, settle_s=120.0)
    assert phase.ok, describe(phase)
    assert phase.verification.verdicts == {"match": 500}, describe(phase)
    assert sum(len(r.input_ids) > OPTIONS.chunked_prefill_size for r in requests) > 300  # several chunks each
    oracle = rig.oracle(set(phase.rooms))
    assert oracle and all(not o["cells"] for o in oracle)
    cached = [int(n) for n in re.findall(r"#cached-token: (\d+)", rig.cluster.logs["prefill"].read_text())]
    assert sum(n > 0 for n in cached) >= 10, "prefill's radix cache gave no prefix hits"
    # coverage (docs/coverage.md): every finished room's index-K bytes verified, none unverified
    status, body = launch.http_get(rig.cluster.server_url("decode") + "/metrics", timeout=10)
    coverage = {}
    for labels, value in re.findall(r'^dsv4_idxk_probe_coverage_bytes_total\{([^}]*)\} (\S+)$', body.decode(), re.M):
        key = tuple(re.search(f'{name}="(\\w+)"', labels)[1] for name in ("outcome", "reason"))
        coverage[key] = coverage.get(key, 0.0) + float(value)
    assert status == 200 and coverage.get(("verified", "none"), 0) > 0, coverage
    assert {key: v for key, v in coverage.items() if v and key != ("verified", "none")} == {}, coverage


def test_every_shipped_fault_is_found_where_and_when_it_shows(rig):
    # after the clean rooms: decode's pages have had occupants, so a stale page or a lost
    # write shows the previous occupant's bytes (a page never used holds zeros)
    requests = workload.plan("faults", workload.fault_workload(shipped_fault_spec(), rooms=48, seed=1))
    phase = rig.phase("faults", requests, faults=str(shipped_fault_spec()))
    assert phase.ok, describe(phase)
    applied = [c for c in phase.verification.checks if c.record["applied"]]
    kinds = {c.record["kind"] for c in applied}
    assert kinds == {"bitflip", "byte_set", "zero_page", "swap_pages", "stale_page", "partial_write", "drop_page"}
    assert {c.record["when"] for c in applied} == {"in_flight", "before_send", "after_recv", "after_step"}
    assert any(c.expected for c in applied) and any(not c.expected for c in applied)  # seen, and invisible by design
    assert phase.verification.verdicts.get("mismatch", 0) >= 8
    # every seen cell was diagnosed as what the rig's bytes show (phase.ok checks each one):
    # every kind of diagnosis occurs, and each fault kind gets its own
    said: dict[str, set] = {}
    for c in applied:
        for e in c.expected:
            if e.get("diagnosis"):
                said.setdefault(c.record["kind"], set()).add(e["diagnosis"]["kind"])
    assert said["zero_page"] == {"zeroed"} and said["bitflip"] == {"unknown"}, said
    assert "other_room" in said["swap_pages"], said
    assert "previous_occupant" in said.get("stale_page", set()) | said.get("drop_page", set()), said
    assert "unknown" in said["partial_write"], said
    # a fault in the transfer's landing names it as the last operation on the page
    landed = [c for c in applied if c.record["when"] == "in_flight" and c.expected]
    assert landed and all("after transfer_landed" in c.diagnosed for c in landed), [c.diagnosed for c in landed]


def test_aborted_requests_are_skipped_and_serving_goes_on(rig):
    requests = workload.plan("abort", workload.WorkloadOptions(rooms=16, seed=3, aborts=(2, 5, 9, 13)))
    phase = rig.phase("abort", requests)
    judged = {r.rid for r in phase.requests if not r.aborted}  # a request the router lost: its resent rid
    assert not phase.failed_requests and not phase.wrong_outputs, describe(phase)
    v = phase.verification
    assert not v.unexplained and not v.oracle_disagreements, describe(phase)
    assert v.verdicts.get("mismatch", 0) == 0 and v.verdicts.get("unverified", 0) == 0, describe(phase)
    assert judged <= set(phase.rooms), "a request sent after the aborts was not verified"


def test_a_room_aborted_mid_decode_is_digested_at_its_release_and_judged(rig):
    """docs/pd.md: a room aborted after decode received it keeps its pages until SGLang
    releases them, so its `decode_finish` digest is taken there and judged, as for any
    finished room; only rooms aborted before their receipt are `skipped`."""
    # the stand-in decodes ~1,000 tokens/s on a quiet machine (6,000 finished in 7.1 s once, before an 8 s hang-up):
    # as many tokens as its 8,192 positions allow, and a hang-up well inside them
    (long,) = workload.plan("midabort", workload.WorkloadOptions(rooms=1, seed=11, min_prompt=600, max_prompt=700,
                                                                min_new_tokens=7400, max_new_tokens=7400))
    request = Request(long.number, long.rid, long.input_ids, long.max_new_tokens, abort_after_s=6.0)
    phase = rig.phase("midabort", [request])
    (outcome,) = phase.outcomes
    assert outcome.status != 200, "the request finished before the client hung up: raise max_new_tokens"

    def stages() -> dict[str, dict]:
        return {r["stage"]: r for r in decode_records(rig) if r.get("rid") == request.rid}

    deadline = time.monotonic() + 60
    while "decode_finish" not in stages() and time.monotonic() < deadline:
        time.sleep(1.0)
    seen = stages()
    assert seen.get("decode_recv", {}).get("verdict") == "match", f"decode never received the room: {seen}"
    assert "decode_step" in seen, "the client hung up before decode stepped the room: raise abort_after_s"
    assert seen["decode_finish"]["verdict"] == "match", seen["decode_finish"]


def test_a_room_aborted_while_it_waits_in_decodes_queue_is_judged_at_its_release(rig):
    """Nine long rooms on a decode server that runs eight at a time (`max_running_requests`):
    once decode received all nine and stepped eight, the ninth waits in its queue, and its
    client hangs up. SGLang's scheduler frees it from there (`abort_request`, its own
    module's `release_kv_cache`), not through the batch's result processor; the probe's
    `pd.decode_release_scheduler` hook takes its `decode_finish` digest and judges it
    (before 2026-12-06 nothing did: the room stayed tracked until the table evicted it).
    Then the eight running rooms' clients hang up too."""
    assert OPTIONS.max_running_requests == 8
    planned = workload.plan("queuedabort", workload.WorkloadOptions(
        rooms=9, seed=13, min_prompt=600, max_prompt=700, min_new_tokens=6000, max_new_tokens=6000,
        shared_prefix_share=0.0))
    hang_ups = {r.rid: threading.Event() for r in planned}
    requests = [Request(r.number, r.rid, r.input_ids, r.max_new_tokens, hang_up=hang_ups[r.rid]) for r in planned]
    seen: dict[str, dict[str, dict]] = {}
    queued: list[str] = []

    def look() -> None:
        seen.clear()
        for r in decode_records(rig):
            if r.get("rid") in hang_ups:
                seen.setdefault(r["rid"], {})[r["stage"]] = r

    def wait_for(done, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            look()
            if done():
                return True
            time.sleep(0.5)
        return False

    def stepped() -> set[str]:
        return {rid for rid, stages in seen.items() if "decode_step" in stages}

    def watch() -> None:
        try:
            if wait_for(lambda: len(seen) == 9 and len(stepped()) == 8, 300):
                queued.extend(set(seen) - stepped())
                hang_ups[queued[0]].set()
                wait_for(lambda: "decode_finish" in seen.get(queued[0], {}), 60)
        finally:
            for event in hang_ups.values():
                event.set()

    watcher = threading.Thread(target=watch, name="queued-abort-watch", daemon=True)
    watcher.start()
    phase = rig.phase("queuedabort", requests, concurrency=9)
    watcher.join(400)
    assert all(o.status != 200 for o in phase.outcomes), "a room finished before its client hung up"
    assert queued, f"decode never held nine rooms with eight of them stepped: {sorted(seen.items())}"
    (waiting,) = queued
    wait_for(lambda: all("decode_finish" in stages for stages in seen.values()), 60)
    stages = seen[waiting]
    assert stages.get("decode_recv", {}).get("verdict") == "match", stages
    assert "decode_step" not in stages, f"the room thought queued was stepped: {stages}"
    assert stages.get("decode_finish", {}).get("verdict") == "match", f"the queued room was not judged: {stages}"
    others = {rid: s.get("decode_finish", {}).get("verdict") for rid, s in seen.items() if rid != waiting}
    assert set(others.values()) == {"match"}, others


NEVER_REACHED = """faults:
  - name: past-the-last-step
    room: 2
    when: {after_step: 500}
    kind: zero_page
"""


def test_a_failed_transfer_leaves_a_record_and_a_fault_never_reached_is_recorded_not_applied(rig, tmp_path):
    """Prefill fails room 1's first transfer at its last send (as its transfer worker does on
    a NIXL error): SGLang aborts that room, and decode's room log says its transfer failed;
    the router sends the request again, as a new room, which is served and judged. Room 2's
    fault comes due after step 500 of a room that decodes 11: it is recorded "not applied:
    room ended at step 11" when the room finishes."""
    spec = tmp_path / "never.yaml"
    spec.write_text(NEVER_REACHED)
    requests = workload.plan("xfail", workload.WorkloadOptions(rooms=3, seed=5, shared_prefix_share=0.0,
                                                              min_new_tokens=12, max_new_tokens=12))
    phase = rig.phase("xfail", requests, faults=str(spec), fail_transfer=(1,))
    assert phase.ok, describe(phase)
    failed_rid = requests[0].rid
    (event,) = [e for e in rig.events({failed_rid}) if e["event"] == "transfer_failed_on_purpose"]

    def failed_records() -> list[dict]:
        return [r for r in decode_records(rig) if int(r["room"]) == event["room"]]

    deadline = time.monotonic() + 30
    while not failed_records() and time.monotonic() < deadline:
        time.sleep(0.5)
    records = failed_records()
    assert [(r["stage"], r["verdict"], r["rid"]) for r in records] == [("decode_recv", "skipped", failed_rid)], records
    assert records[0]["reason"] == "transfer failed: dsv4-idxk-probe rig: transfer failed on purpose", records[0]

    (never,) = [f for f in phase.faults if f["rig_room"] == 2]
    assert never["applied"] is False and never["reason"] == f"room ended at step {requests[1].max_new_tokens - 1}", never


def test_the_warm_up_room_on_the_fake_bootstrap_host_is_skipped(rig):
    skipped = [r for r in decode_records(rig) if r.get("verdict") == "skipped"]
    assert any("fake bootstrap host" in str(r.get("reason")) for r in skipped), skipped[:3]


def test_probe_metrics_are_on_sglangs_own_metrics_endpoint(rig):
    status, body = launch.http_get(rig.cluster.server_url("decode") + "/metrics", timeout=10)
    assert status == 200
    text = body.decode()
    matches = re.findall(r'dsv4_idxk_probe_rooms_verified_total\{[^}]*stage="decode_finish"[^}]*verdict="match"[^}]*\} (\S+)', text)
    assert matches and float(matches[0]) >= 1, text[:2000]
    status, body = launch.http_get(rig.cluster.server_url("prefill") + "/metrics", timeout=10)
    assert status == 200 and "dsv4_idxk_probe_rooms_digested_total" in body.decode()
