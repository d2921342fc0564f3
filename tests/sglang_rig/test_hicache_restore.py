"""HiCache restores verified by default (docs/hicache.md, "Restore verification"), on
SGLang's own prefill with HiCache on and round-trip mode OFF (the shipped defaults):
the device pages each backup reads are digested and kept per host row; the device
pages each load writes are digested after it and compared. A host row changed
between its backup and its load reaches prefill's device page before prefill's PD
digest, so every PD digest point says `match`; restore verification names it at
stage `hicache_load`, with its pool, layer, host row, device page and segment."""

from __future__ import annotations

from dsv4_idxk_probe.testbed.sglang import launch, workload
from dsv4_idxk_probe.testbed.sglang.workload import Request

from .conftest import describe, pair_fixture
from .test_pd_hicache import HOST_ROW_FAULT, INDEXER_POOL, PROMPTS, counters, hicache_records, wait_for

OPTIONS = launch.ServerOptions(prefill_hicache=True, extra_prefill=("--max-total-tokens", "16384"))
PROBE_CONFIG = "step_interval: 4\nhicache:\n  flush_interval_s: 1.0\n"  # restore verification by default
STAGE = "hicache_load"

rig = pair_fixture("sglang-hicache-restore", OPTIONS, PROBE_CONFIG)


def verdicts(session, verdict: str) -> float:
    return counters(session, "rooms_verified_total", stage=STAGE, verdict=verdict)


def findings(session) -> list[dict]:
    return [r for r in hicache_records(session) if r.get("event") == "restore_mismatch"]


def evict_then_resend(session, name: str, seed: int, number: int, faults: str | None = None):
    """One room's prompt, sixteen filler rooms that push its pages out to the host pool, and
    the prompt again: loaded back from the host pool in that round."""
    (first,) = workload.plan(name, workload.WorkloadOptions(rooms=1, seed=seed, **PROMPTS))
    phase = session.phase(f"{name}-seed", [Request(number, f"{name}-seed", first.input_ids, first.max_new_tokens)])
    assert phase.ok, describe(phase)
    fill = workload.plan(f"{name}fill", workload.WorkloadOptions(rooms=16, seed=seed + 100, **PROMPTS))
    phase = session.phase(f"{name}-fill", [Request(number + 1 + r.number, r.rid, r.input_ids, r.max_new_tokens)
                                           for r in fill])
    assert phase.ok, describe(phase)
    again = Request(number + 50, f"{name}-again", first.input_ids, first.max_new_tokens)
    return session.phase(name, [again], faults=faults)


def test_clean_hicache_traffic_is_verified_at_hicache_load_with_no_finding(rig):
    """Round trip off: backups digested, loads compared, every load a match, every index-K
    byte of the loads counted verified, nothing reported, no probe error."""
    assert counters(rig, "hicache_roundtrip_total") == 0  # round-trip mode is off
    phase = evict_then_resend(rig, "clean", seed=8, number=10)
    assert phase.ok, describe(phase)
    assert phase.verification.verdicts == {"match": 1}, describe(phase)
    assert wait_for(lambda: verdicts(rig, "match") > 0, timeout_s=30), "no load was compared at hicache_load"
    assert verdicts(rig, "mismatch") == 0 and findings(rig) == []
    verified = counters(rig, "coverage_bytes_total", path="hicache_load", outcome="verified", reason="none")
    assert verified > 0 and verified % (8448 * 2) == 0, verified  # whole host rows of both C4 layers
    assert counters(rig, "coverage_bytes_total", path="hicache_backup", outcome="verified", reason="none") > 0
    assert counters(rig, "coverage_bytes_total", path="hicache_load", outcome="unverified") == 0
    assert counters(rig, "errors_total") == 0


def test_a_host_row_changed_before_its_load_is_found_at_hicache_load_with_its_cells(rig, tmp_path):
    spec = tmp_path / "host-row.yaml"
    spec.write_text(HOST_ROW_FAULT.replace("room: 300", "room: 350"))
    mismatches_before = verdicts(rig, "mismatch")
    phase = evict_then_resend(rig, "hostrow", seed=21, number=300, faults=str(spec))
    applied = [f for f in phase.faults if f["applied"]]
    assert applied, [f["reason"] for f in phase.faults]
    (fault,) = applied
    (where,) = fault["roundtrip"]  # the host row and device page the injector changed and the load used
    # every PD digest point matches (both sides digest the changed bytes); decode's oracle sees them
    assert phase.verification.verdicts == {"match": 1}, describe(phase)
    assert fault["effects"] and all(e["oracle_stage"] == "decode_recv" for e in fault["effects"]), fault
    want = {(3, 1, where["host_row"], where["device_page"], segment)
            for e in fault["effects"] for segment in e["segments"]}
    assert want and {w[4] for w in want} == {"payload"}

    assert wait_for(lambda: verdicts(rig, "mismatch") > mismatches_before, timeout_s=30), \
        "restore verification did not report the changed host row"
    # prefill's room-log writer flushes on its own thread: the record may follow the metric
    assert wait_for(lambda: findings(rig), timeout_s=30), "no restore_mismatch record in prefill's room log"
    (found,) = findings(rig)
    assert (found["stage"], found["pool"], found["layout"]) == (STAGE, INDEXER_POOL, "fp8")
    got = {(c["layer"], c["pool_layer"], c["host_row"], c["device_page"], c["segment"]) for c in found["cells"]}
    assert got == want, (got, want)
    assert found["mismatch_rows"] == [where["host_row"]]
    # diagnosed with the journal: the device page's last event is this load, naming the host row
    (diag,) = found["diagnosis"]
    last = diag["events"][-1]
    assert (diag["device_page"], last["event"], last["host_row"], last["pool"]) == (
        where["device_page"], "hicache_load", where["host_row"], INDEXER_POOL)
    assert counters(rig, "mismatch_cells_total", stage=STAGE, segment="payload") >= 1
    assert counters(rig, "mismatch_layer_hits_total", stage=STAGE, layer="3") >= 1
    assert counters(rig, "hicache_roundtrip_total") == 0 and counters(rig, "errors_total") == 0
