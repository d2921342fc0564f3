"""The storage tier through a zero-copy backend: SGLang's own `MooncakeStore` methods on a real
Mooncake store (its `mooncake_master` on loopback, TCP), moving a real host pool's pages by
address. No digests travel with these pages: a page read back is counted on `l3` as
`unverified` (`digest_lost`), never verified and never a finding; a page only stored keeps its
host row's digests, so the row's next load is still verified."""

from __future__ import annotations

import inspect
import os
import time

import pytest

from dsv4_idxk_probe.testbed.sglang.mooncake_master import MasterError, MooncakeMaster, running_master

from .conftest import LAYERS, host_row, page_indices
from .test_restore_pools import backup, findings, load, settle
from .test_restore_storage_tier import assert_load_unverified

POOL = "deepseek_v4_c4_indexer"


def _packs_every_pool() -> bool:
    """Whether this release's Mooncake path packs a page's per-layer buffers into one object
    for every pool (0.5.19 on). 0.5.18 packs only the C4 KV pool's: an indexer page of
    several layers is stored as its first layer's bytes and cannot be read back (SGLang's own
    behaviour there, with or without the probe)."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    return "if transfer.name == PoolName.DEEPSEEK_V4_C4:" not in inspect.getsource(MooncakeStore._batch_io_v2)


pytestmark = pytest.mark.skipif(not _packs_every_pool(), reason=(
    "SGLang 0.5.18 cannot store a multi-layer DeepSeek-V4 indexer page through Mooncake "
    "(it packs only the C4 KV pool's buffers)"))


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    try:
        with running_master(tmp_path_factory.mktemp("mooncake") / "master.log") as running:
            yield running
    except MasterError as exc:
        pytest.fail(str(exc), pytrace=False)


def mooncake_backend(master: MooncakeMaster, pool):
    """SGLang's MooncakeStore, its methods as shipped, holding a connected store and the pool
    registered as the hybrid stack registers it (the rest of its __init__ wants a server)."""
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", master.metadata_url, 64 << 20, 16 << 20, "tcp", "", master.address) == 0
    for layer in pool.kv_buffer:  # zero-copy moves only registered memory
        assert store.register_buffer(layer.data_ptr(), layer.numel() * layer.element_size()) == 0
    backend = object.__new__(MooncakeStore)
    backend.__dict__.update(
        store=store, registered_pools={PoolName.DEEPSEEK_V4_C4_INDEXER: pool}, config_prefix=None,
        _use_group_semantics=False, _supports_session_ids=False, _replicate_config_cls=ReplicateConfig,
        mla_suffix="", mha_suffix="0", is_mla_backend=True)
    return backend


def _transfer(rows, keys):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    return [PoolTransfer(name=PoolName.DEEPSEEK_V4_C4_INDEXER, host_indices=page_indices(rows), keys=keys)]


@pytest.fixture
def backed_up(hicache, make_pool, master):
    """A pool's device pages backed up to its host rows (2 and 5), their digests kept, and
    SGLang's MooncakeStore over it."""
    env = hicache()
    pool = make_pool("fp8_indexer")
    backup(pool)
    settle(env)
    backend = mooncake_backend(master, pool)
    yield env, pool, backend
    backend.store.close()


def test_a_page_read_back_through_mooncake_is_counted_l3_unverified_and_never_a_finding(backed_up):
    env, pool, backend = backed_up
    key = f"page-5-{os.getpid()}-{time.monotonic_ns()}"
    assert backend.batch_set_v2(_transfer([5], [key]))[POOL] == [True]
    kept = [host_row(pool, 5, layer).clone() for layer in range(LAYERS)]
    for layer in range(LAYERS):
        host_row(pool, 5, layer).zero_()  # evicted and reused
    assert backend.batch_get_v2(_transfer([5], [key]))[POOL] == [True]
    assert all(host_row(pool, 5, layer).equal(kept[layer]) for layer in range(LAYERS))  # Mooncake put it back
    assert_load_unverified(env, pool)  # row 5: l3 and its load digest_lost; row 2 compared


def test_a_page_mooncake_does_not_hold_counts_nothing_on_l3(backed_up):
    env, pool, backend = backed_up
    assert backend.batch_get_v2(_transfer([5], [f"absent-{time.monotonic_ns()}"]))[POOL] == [False]
    settle(env)
    assert env.value("coverage_bytes", path="l3", outcome="unverified", reason="digest_lost") is None


def test_a_page_only_stored_in_mooncake_keeps_its_digests_and_its_load_is_verified(backed_up):
    env, pool, backend = backed_up
    assert backend.batch_set_v2(_transfer([2, 5], [f"p2-{time.monotonic_ns()}", f"p5-{time.monotonic_ns()}"]))[
        POOL] == [True, True]
    load(pool)
    settle(env)
    assert findings(env) == []
    assert env.value("rooms_verified", stage="hicache_load", verdict="match") == 1
    assert env.value("coverage_bytes", path="hicache_load", outcome="verified", reason="none") == 2 * LAYERS * pool.item_bytes
