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

from dsv4_idxk_probe.testbed.sglang import launch

from . import zero_copy_storage as cases
from .conftest import start_session
from .test_hicache_storage import PROBE_CONFIG


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
    cases.stored_rows_keep_their_digests(rig, lambda: stored_files(rig), "NIXL's storage folder", "nxclean", seed=9)


def test_a_prompt_restored_through_nixl_is_counted_l3_unverified_and_is_never_a_finding(rig):
    cases.restored_pages_count_l3_unverified(rig, lambda: stored_files(rig), "NIXL's storage folder", "nxl3", seed=53,
                                             number=700)
