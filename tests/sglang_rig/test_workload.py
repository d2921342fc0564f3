"""The rig's request plan (no servers): prompts of rooms a prefill-side fault changes are
never repeated by later prompts, so the fault cannot reach other rooms through prefill's
radix cache (where both sides would see the same changed bytes and the oracle would not)."""

from __future__ import annotations

from dsv4_idxk_probe.testbed.sglang import workload
from dsv4_idxk_probe.testbed.sglang.launch import PAGE_SIZE
from dsv4_idxk_probe.testbed.faults.summary import shipped_fault_spec


def donors(plan) -> set[int]:
    """Rooms whose first page another prompt has too."""
    return {a.number for a in plan for b in plan
            if a.number != b.number and a.input_ids[:PAGE_SIZE] == b.input_ids[:PAGE_SIZE]}


def test_the_shipped_prefill_faults_rooms_are_kept_private():
    private = workload.prefill_fault_rooms(shipped_fault_spec())
    assert private and all(isinstance(r, int) for r in private)
    shared = workload.plan("x", workload.WorkloadOptions(rooms=48, seed=0))
    assert donors(shared) & set(private), "seed 0 no longer shares a faulted room: pick a seed that does"
    for seed in range(6):
        plan = workload.plan("x", workload.WorkloadOptions(rooms=48, seed=seed, private=private))
        assert not donors(plan) & set(private), seed
        assert donors(plan), "prefix sharing must still happen"


def test_no_private_rooms_leaves_the_plan_as_it_was():
    a = workload.plan("x", workload.WorkloadOptions(rooms=32, seed=3))
    b = workload.plan("x", workload.WorkloadOptions(rooms=32, seed=3, private=()))
    assert a == b


def test_a_swap_faults_rooms_decode_long_enough_for_a_partner_to_arrive():
    opts = workload.fault_workload(shipped_fault_spec(), rooms=48, seed=1)
    assert opts.long_rooms == workload.swap_fault_rooms(shipped_fault_spec()) and opts.long_rooms
    assert opts.private == workload.prefill_fault_rooms(shipped_fault_spec())
    plan = {r.number: r for r in workload.plan("x", opts)}
    plain = {r.number: r for r in workload.plan("x", workload.WorkloadOptions(rooms=48, seed=1, private=opts.private))}
    for n, req in plan.items():
        if n in opts.long_rooms:
            assert req.max_new_tokens >= opts.long_new_tokens > plain[n].max_new_tokens
        else:
            assert req == plain[n]  # every other room as it was: prompts, lengths, seeds
