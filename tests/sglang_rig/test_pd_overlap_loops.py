"""The same SGLang pair with its overlap event loops on both sides (the next forward
is launched before the last one's results are processed), no decode radix cache."""

from __future__ import annotations

from dsv4_idxk_probe.testbed.sglang import launch, workload
from dsv4_idxk_probe.testbed.faults.summary import shipped_fault_spec

from .conftest import describe, pair_fixture


rig = pair_fixture("sglang-overlap", launch.ServerOptions(overlap=True))


def test_every_shipped_fault_is_found_with_the_overlap_loops(rig):
    requests = workload.plan("faults", workload.fault_workload(shipped_fault_spec(), rooms=32, seed=4))
    phase = rig.phase("faults", requests, faults=str(shipped_fault_spec()))
    assert phase.ok, describe(phase)
    assert sum(1 for c in phase.verification.checks if c.record["applied"] and c.expected) >= 8, describe(phase)


def test_clean_rooms_match_with_the_overlap_loops(rig):
    requests = workload.plan("clean", workload.WorkloadOptions(rooms=100, seed=5))
    phase = rig.phase("clean", requests)
    assert phase.ok, describe(phase)
    assert phase.verification.verdicts == {"match": 100}, describe(phase)


def test_finish_digest_reads_the_pages_before_sglang_frees_them(rig):
    """Finding 2: a finished room's pages are freed inside the batch's result processing;
    whoever writes a freed page next (the next room's transfer, a HiCache load) must not
    change what the room's `decode_finish` digest read. The rig zeroes every finished
    room's pages right after SGLang frees them: every finish must still match."""
    requests = workload.plan("freed", workload.WorkloadOptions(rooms=24, seed=6))
    phase = rig.phase("freed", requests, scribble_freed=True)
    assert len(rig.events(set(phase.rooms))) == 24  # every room's pages were overwritten after the free
    assert phase.ok, describe(phase)
    assert phase.verification.verdicts == {"match": 24}, describe(phase)
