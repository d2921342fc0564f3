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

from dsv4_idxk_probe.testbed.sglang import launch
from dsv4_idxk_probe.testbed.sglang.mooncake_master import MasterError, running_master

from . import zero_copy_storage as cases
from .conftest import start_session
from .test_hicache_storage import PROBE_CONFIG
from .test_pd_hicache import INDEXER_POOL


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
    cases.stored_rows_keep_their_digests(rig, lambda: stored_indexer_pages(rig), "Mooncake", "mcclean", seed=8)


def test_a_prompt_restored_from_mooncake_is_counted_l3_unverified_and_is_never_a_finding(rig):
    cases.restored_pages_count_l3_unverified(rig, lambda: stored_indexer_pages(rig), "Mooncake", "mcl3", seed=52,
                                             number=600)
