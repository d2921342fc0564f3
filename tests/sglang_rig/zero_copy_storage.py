"""What the SGLang rig checks of each zero-copy storage tier (Mooncake, NIXL) on SGLang's own
prefill, write-through with `wait_complete` prefetches. No digests travel with these pages
(docs/hicache.md, "The storage tier"): a page the store only stored keeps its host row's
digests, so the row's next load is still compared; a page the store reads back into a host row
is counted `l3`/`unverified`/`digest_lost`, its load likewise, and is never a finding.

Each module passes its pair, what the store holds now (`stored()`, a set of names) and the
store's name for the messages."""

from __future__ import annotations

from typing import Callable

from dsv4_idxk_probe.testbed.sglang import workload
from dsv4_idxk_probe.testbed.sglang.workload import Request

from .conftest import describe
from .test_hicache_storage import evict_then_resend, flush_device_and_host, load_verdicts, resend, \
    restore_findings
from .test_pd_hicache import PROMPTS, counters, wait_for

PAGE_BYTES = 8448 * 2  # one host row of the rig's two C4 layers


def stored_rows_keep_their_digests(rig, stored: Callable[[], set], store: str, name: str, seed: int) -> None:
    """Write-through: each backup is stored right after it; the prompt's rows, loaded back from
    the host pool afterwards, are compared, none counted `digest_lost`."""
    phase = evict_then_resend(rig, name, seed=seed, number=10)
    assert phase.ok, describe(phase)
    assert phase.verification.verdicts == {"match": 1}, describe(phase)
    assert wait_for(stored, timeout_s=30), f"no page reached {store}"
    assert wait_for(lambda: load_verdicts(rig, "match") > 0, timeout_s=30), "no load was compared at hicache_load"
    assert wait_for(lambda: counters(rig, "coverage_bytes_total", path="hicache_load", outcome="verified",
                                     reason="none") > 0, timeout_s=30), "no verified hicache_load bytes counted"
    assert counters(rig, "coverage_bytes_total", path="hicache_load", outcome="unverified") == 0
    assert counters(rig, "coverage_bytes_total", path="l3") == 0  # nothing read back yet
    assert load_verdicts(rig, "mismatch") == 0 and restore_findings(rig) == []
    assert counters(rig, "errors_total") == 0


def restored_pages_count_l3_unverified(rig, stored: Callable[[], set], store: str, name: str, seed: int,
                                       number: int) -> None:
    """A prompt flushed from the device and host pools is prefetched from the store when sent
    again: its pages count on `l3` in whole rows, their loads likewise, never a finding."""
    before = stored()
    (first,) = workload.plan(name, workload.WorkloadOptions(rooms=1, seed=seed, **PROMPTS))
    phase = rig.phase(f"{name}-seed", [Request(number, f"{name}-seed", first.input_ids, first.max_new_tokens)])
    assert phase.ok, describe(phase)
    assert wait_for(lambda: stored() - before), f"the prompt's pages never reached {store}"
    flush_device_and_host(rig)
    lost_before = counters(rig, "coverage_bytes_total", path="l3", outcome="unverified", reason="digest_lost")
    mismatches_before, known = load_verdicts(rig, "mismatch"), len(restore_findings(rig))
    phase = resend(rig, name, first, number + 50)
    assert phase.ok, describe(phase)
    assert phase.verification.verdicts == {"match": 1}, describe(phase)
    # the copy path's counts reach /metrics through the flusher (flush_interval_s)
    assert wait_for(lambda: counters(rig, "coverage_bytes_total", path="l3", outcome="unverified",
                                     reason="digest_lost") > lost_before, timeout_s=30), \
        f"the pages {store} read back were not counted on l3"
    read = counters(rig, "coverage_bytes_total", path="l3", outcome="unverified", reason="digest_lost") - lost_before
    assert read % PAGE_BYTES == 0, read  # whole host rows of both C4 layers
    assert counters(rig, "coverage_bytes_total", path="l3", outcome="verified") == 0
    assert wait_for(lambda: counters(rig, "coverage_bytes_total", path="hicache_load", outcome="unverified",
                                     reason="digest_lost") > 0, timeout_s=30), "their loads were not counted"
    assert load_verdicts(rig, "mismatch") == mismatches_before and restore_findings(rig)[known:] == []
    assert counters(rig, "errors_total") == 0
