"""HiCache's storage tier through SGLang's NIXL backend on SGLang's own prefill
(`--hicache-storage-backend nixl`, `HiCacheNixl`: NIXL's POSIX plugin writing page files in a
folder of the test's, O_DIRECT off), which moves DeepSeek-V4's host rows by address (zero copy).
One server pair for the module.

No digests travel with these pages (docs/hicache.md, "The storage tier"): a page NIXL only
stores keeps its host row's digests, so the row's next load is still compared; a page NIXL reads
back into a host row is counted `l3`/`unverified`/`digest_lost`, its load likewise, and is never
a finding. Before 2026-12-06 the first came out `digest_lost` and the second counted nothing on `l3`."""

from __future__ import annotations

import json

import pytest

from dsv4_idxk_probe.testbed.sglang import launch, workload
from dsv4_idxk_probe.testbed.sglang.workload import Request

from .conftest import describe, start_session
from .test_hicache_storage import PROBE_CONFIG, evict_then_resend, flush_device_and_host, load_verdicts, \
    resend, restore_findings
from .test_pd_hicache import PROMPTS, counters, wait_for

PAGE_BYTES = 8448 * 2  # one host row of the rig's two C4 layers


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    folder = tmp_path_factory.mktemp("nixl-storage")
    extra = {"plugin": {"posix": {"active": True}}, "use_direct_io": False, "l3_cleaner_enabled": False}
    options = launch.ServerOptions(
        prefill_hicache=True, hicache_mem_layout="page_first_direct", prefill_env=(("SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR", str(folder)),),
        extra_prefill=("--max-total-tokens", "16384", "--hicache-storage-backend", "nixl",
                       "--hicache-write-policy", "write_through",
                       "--hicache-storage-backend-extra-config", json.dumps(extra),
                       "--hicache-storage-prefetch-policy", "wait_complete"))
    session = start_session(tmp_path_factory, "sglang-hicache-nixl", options, PROBE_CONFIG)
    session.storage = folder
    yield session
    session.stop()


def stored_files(session) -> set[str]:
    return {p.name for p in session.storage.rglob("*") if p.is_file()}


def test_rows_nixl_stored_keep_their_digests_and_their_loads_are_verified(rig):
    phase = evict_then_resend(rig, "nxclean", seed=9, number=10)
    assert phase.ok, describe(phase)
    assert phase.verification.verdicts == {"match": 1}, describe(phase)
    assert wait_for(lambda: stored_files(rig), timeout_s=30), "no page reached NIXL's storage folder"
    assert wait_for(lambda: load_verdicts(rig, "match") > 0, timeout_s=30), "no load was compared at hicache_load"
    assert wait_for(lambda: counters(rig, "coverage_bytes_total", path="hicache_load", outcome="verified",
                                     reason="none") > 0, timeout_s=30), "no verified hicache_load bytes counted"
    assert counters(rig, "coverage_bytes_total", path="hicache_load", outcome="unverified") == 0
    assert counters(rig, "coverage_bytes_total", path="l3") == 0  # nothing read back yet
    assert load_verdicts(rig, "mismatch") == 0 and restore_findings(rig) == []
    assert counters(rig, "errors_total") == 0


def test_a_prompt_restored_through_nixl_is_counted_l3_unverified_and_is_never_a_finding(rig):
    before = stored_files(rig)
    (first,) = workload.plan("nxl3", workload.WorkloadOptions(rooms=1, seed=53, **PROMPTS))
    phase = rig.phase("nxl3-seed", [Request(700, "nxl3-seed", first.input_ids, first.max_new_tokens)])
    assert phase.ok, describe(phase)
    assert wait_for(lambda: stored_files(rig) - before), "the prompt's pages never reached NIXL's storage folder"
    flush_device_and_host(rig)
    lost_before = counters(rig, "coverage_bytes_total", path="l3", outcome="unverified", reason="digest_lost")
    mismatches_before, known = load_verdicts(rig, "mismatch"), len(restore_findings(rig))
    phase = resend(rig, "nxl3", first, 750)
    assert phase.ok, describe(phase)
    assert phase.verification.verdicts == {"match": 1}, describe(phase)
    assert wait_for(lambda: counters(rig, "coverage_bytes_total", path="l3", outcome="unverified",
                                     reason="digest_lost") > lost_before, timeout_s=30), \
        "the pages NIXL read back were not counted on l3"
    read = counters(rig, "coverage_bytes_total", path="l3", outcome="unverified", reason="digest_lost") - lost_before
    assert read % PAGE_BYTES == 0, read  # whole host rows of both C4 layers
    assert counters(rig, "coverage_bytes_total", path="l3", outcome="verified") == 0
    assert wait_for(lambda: counters(rig, "coverage_bytes_total", path="hicache_load", outcome="unverified",
                                     reason="digest_lost") > 0, timeout_s=30), "their loads were not counted"
    assert load_verdicts(rig, "mismatch") == mismatches_before and restore_findings(rig)[known:] == []
    assert counters(rig, "errors_total") == 0
