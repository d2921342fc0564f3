"""The storage tier through SGLang's NIXL backend (`HiCacheNixl`) with NIXL's POSIX plugin: a real
NIXL agent moving a real host pool's pages to and from files, by address where the pool allows it
(zero copy, the path DeepSeek-V4's host pools take), else through SGLang's bounce buffers.

No digests travel with these pages: a page read back is counted on `l3` as `unverified`
(`digest_lost`), never verified and never a finding; a page only stored keeps its host row's
digests, so the row's next load is still verified."""

from __future__ import annotations

import pytest

from .conftest import LAYERS, host_row, page_indices
from .test_restore_pools import backup, findings, load, settle
from .test_restore_storage_tier import assert_load_unverified

POOL = "deepseek_v4_c4_indexer"


def nixl_backend(tmp_path, pool, zero_copy: bool = True):
    """SGLang's HiCacheNixl as the hybrid stack builds it, on NIXL's POSIX plugin in `tmp_path`,
    the pool registered; `zero_copy=False` makes it take its bounce buffers (as for a pool that
    is not page aligned under O_DIRECT)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
    from sglang.srt.mem_cache.storage.nixl.hicache_nixl import HiCacheNixl

    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=True,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="test",
        extra_config={"plugin": {"posix": {"active": True}}, "use_direct_io": False, "l3_cleaner_enabled": False})
    backend = HiCacheNixl(config, file_path=str(tmp_path))
    if not zero_copy:
        backend._hybrid_pool_supports_zero_copy = lambda *_a: False
    backend.register_mem_host_pool_v2(pool, PoolName.DEEPSEEK_V4_C4_INDEXER)
    assert backend._hybrid_pool_ctx[PoolName.DEEPSEEK_V4_C4_INDEXER].is_zero_copy is zero_copy
    return backend


def _transfer(rows, keys):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    return [PoolTransfer(name=PoolName.DEEPSEEK_V4_C4_INDEXER, host_indices=page_indices(rows), keys=keys)]


@pytest.fixture(params=[True, False], ids=["zero_copy", "bounce"])
def backed_up(request, hicache, make_pool, tmp_path):
    """A pool's device pages backed up to its host rows (2 and 5), their digests kept, and
    SGLang's HiCacheNixl over it."""
    env = hicache()
    pool = make_pool("fp8_indexer")
    backup(pool)
    settle(env)
    return env, pool, nixl_backend(tmp_path, pool, zero_copy=request.param)


def test_a_page_read_back_through_nixl_is_counted_l3_unverified_once_and_never_a_finding(backed_up):
    env, pool, backend = backed_up
    assert backend.batch_set_v2(_transfer([5], ["page-5"]))[POOL] == [True]
    kept = [host_row(pool, 5, layer).clone() for layer in range(LAYERS)]
    for layer in range(LAYERS):
        host_row(pool, 5, layer).zero_()  # evicted and reused
    assert backend.batch_get_v2(_transfer([5], ["page-5"]))[POOL] == [True]
    assert all(host_row(pool, 5, layer).equal(kept[layer]) for layer in range(LAYERS))  # NIXL put it back
    assert_load_unverified(env, pool)  # row 5: l3 and its load digest_lost, once; row 2 compared


def test_a_page_nixl_does_not_hold_counts_nothing_on_l3(backed_up):
    env, pool, backend = backed_up
    assert backend.batch_get_v2(_transfer([5], ["absent"]))[POOL] == [False]
    settle(env)
    assert env.value("coverage_bytes", path="l3", outcome="unverified", reason="digest_lost") is None


def test_a_page_only_stored_through_nixl_keeps_its_digests_and_its_load_is_verified(backed_up):
    env, pool, backend = backed_up
    assert backend.batch_set_v2(_transfer([2, 5], ["p2", "p5"]))[POOL] == [True, True]
    load(pool)
    settle(env)
    assert findings(env) == []
    assert env.value("rooms_verified", stage="hicache_load", verdict="match") == 1
    assert env.value("coverage_bytes", path="hicache_load", outcome="verified", reason="none") == 2 * LAYERS * pool.item_bytes
