"""HiCache's storage tier through Mooncake on SGLang's own prefill (`--hicache-storage-backend
mooncake`, `MooncakeStore`: a zero-copy store that reads and writes host rows by address), a real
`mooncake_master` beside the pair, every port on loopback, TCP. One server pair for the module.

No digests travel with a Mooncake page (docs/hicache.md, "The storage tier"), so what the probe
owes here is its accounting: a page Mooncake only stores keeps its host row's digests, so the
row's next load is still compared (before, the store's address request made the probe forget
them); a page Mooncake reads back into a host row is counted `l3`/`unverified`/`digest_lost`,
its load likewise, and is never a finding."""

from __future__ import annotations

import json

import pytest

from dsv4_idxk_probe.testbed.sglang import launch, workload
from dsv4_idxk_probe.testbed.sglang.mooncake_master import MasterError, running_master
from dsv4_idxk_probe.testbed.sglang.workload import Request

from .conftest import describe, start_session
from .test_hicache_storage import PROBE_CONFIG, evict_then_resend, flush_device_and_host, load_verdicts, \
    resend, restore_findings
from .test_pd_hicache import INDEXER_POOL, PROMPTS, counters, wait_for

PAGE_BYTES = 8448 * 2  # one host row of the rig's two C4 layers


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    try:
        with running_master(tmp_path_factory.mktemp("mooncake") / "master.log") as master:
            extra = {"master_server_address": master.address, "metadata_server": master.metadata_url,
                     "protocol": "tcp", "local_hostname": "127.0.0.1", "global_segment_size": 256 << 20}
            options = launch.ServerOptions(prefill_hicache=True, extra_prefill=(
                "--max-total-tokens", "16384", "--hicache-storage-backend", "mooncake",
                "--hicache-write-policy", "write_through",
                "--hicache-storage-backend-extra-config", json.dumps(extra),
                "--hicache-storage-prefetch-policy", "wait_complete"))
            session = start_session(tmp_path_factory, "sglang-hicache-mooncake", options, PROBE_CONFIG)
            session.master = master
            yield session
            session.stop()
    except MasterError as exc:
        pytest.fail(str(exc), pytrace=False)


def stored_indexer_pages(session) -> set[str]:
    """The index-K pool's page objects Mooncake holds (its C4 state pool is another pool)."""
    return {k for k in session.master.keys() if k.endswith(f"_{INDEXER_POOL}")}


def test_rows_mooncake_stored_keep_their_digests_and_their_loads_are_verified(rig):
    """Write-through: each backup is stored in Mooncake right after it; the prompt's rows, loaded
    back from the host pool afterwards, are compared, none counted `digest_lost`."""
    phase = evict_then_resend(rig, "mcclean", seed=8, number=10)
    assert phase.ok, describe(phase)
    assert phase.verification.verdicts == {"match": 1}, describe(phase)
    assert wait_for(lambda: stored_indexer_pages(rig), timeout_s=30), "no index-K page reached Mooncake"
    assert wait_for(lambda: load_verdicts(rig, "match") > 0, timeout_s=30), "no load was compared at hicache_load"
    assert wait_for(lambda: counters(rig, "coverage_bytes_total", path="hicache_load", outcome="verified",
                                     reason="none") > 0, timeout_s=30), "no verified hicache_load bytes counted"
    assert counters(rig, "coverage_bytes_total", path="hicache_load", outcome="unverified") == 0
    assert counters(rig, "coverage_bytes_total", path="l3") == 0  # nothing read from Mooncake yet
    assert load_verdicts(rig, "mismatch") == 0 and restore_findings(rig) == []
    assert counters(rig, "errors_total") == 0


def test_a_prompt_restored_from_mooncake_is_counted_l3_unverified_and_is_never_a_finding(rig):
    before = stored_indexer_pages(rig)
    (first,) = workload.plan("mcl3", workload.WorkloadOptions(rooms=1, seed=52, **PROMPTS))
    phase = rig.phase("mcl3-seed", [Request(600, "mcl3-seed", first.input_ids, first.max_new_tokens)])
    assert phase.ok, describe(phase)
    assert wait_for(lambda: stored_indexer_pages(rig) - before), "the prompt's index-K pages never reached Mooncake"
    flush_device_and_host(rig)
    lost_before = counters(rig, "coverage_bytes_total", path="l3", outcome="unverified", reason="digest_lost")
    mismatches_before, known = load_verdicts(rig, "mismatch"), len(restore_findings(rig))
    phase = resend(rig, "mcl3", first, 650)
    assert phase.ok, describe(phase)
    assert phase.verification.verdicts == {"match": 1}, describe(phase)
    # the copy path's counts reach /metrics through the flusher (flush_interval_s)
    assert wait_for(lambda: counters(rig, "coverage_bytes_total", path="l3", outcome="unverified",
                                     reason="digest_lost") > lost_before, timeout_s=30), \
        "the pages Mooncake read back were not counted on l3"
    read = counters(rig, "coverage_bytes_total", path="l3", outcome="unverified", reason="digest_lost") - lost_before
    assert read % PAGE_BYTES == 0, read  # whole host rows of both C4 layers
    assert counters(rig, "coverage_bytes_total", path="l3", outcome="verified") == 0
    assert wait_for(lambda: counters(rig, "coverage_bytes_total", path="hicache_load", outcome="unverified",
                                     reason="digest_lost") > 0, timeout_s=30), "their loads were not counted"
    assert load_verdicts(rig, "mismatch") == mismatches_before and restore_findings(rig)[known:] == []
    assert counters(rig, "errors_total") == 0
