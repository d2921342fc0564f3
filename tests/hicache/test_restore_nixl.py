"""The storage tier through SGLang's NIXL backend (`HiCacheNixl`) with NIXL's POSIX plugin: a real
NIXL agent moving a real host pool's pages to and from files, by address where the pool allows it
(zero copy, the path DeepSeek-V4's host pools take), else through SGLang's bounce buffers.

The cases are every zero-copy backend's (`zero_copy_cases`); in the bounce form the page reaches
its row through `set_from_flat_data_page` instead, and must still count once."""

from __future__ import annotations

import pytest

from . import zero_copy_cases as cases
from .test_restore_pools import backup, load, settle


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
    cases.read_back_is_counted_l3_unverified(env, pool, backend, load, "page-5")


def test_a_page_nixl_does_not_hold_counts_nothing_on_l3(backed_up):
    env, _pool, backend = backed_up
    cases.a_miss_counts_nothing(env, backend, "absent")


def test_a_page_only_stored_through_nixl_keeps_its_digests_and_its_load_is_verified(backed_up):
    env, pool, backend = backed_up
    cases.only_stored_keeps_the_rows_digests(env, pool, backend, load, ["p2", "p5"])


def test_a_transfer_nixl_refuses_itself_counts_nothing_and_no_error_of_the_probe(hicache, make_pool, tmp_path):
    """NIXL refuses a zero-copy transfer whose indices are not a page per key (SGLang logs it
    and returns False for each key, moving nothing): nothing is counted on `l3`, and the probe
    counts no error of its own (the teardown checks: its alert would fire for nothing)."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    env = hicache()
    pool = make_pool("fp8_indexer")
    backend = nixl_backend(tmp_path, pool)
    page = pool.slot_page_size
    one_and_a_half = torch.arange(5 * page, 5 * page + page + page // 2)
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.DEEPSEEK_V4_C4_INDEXER, host_indices=one_and_a_half,
                                             keys=["page-5"])])
    assert got[cases.POOL] == [False]
    settle(env)
    assert env.value("coverage_bytes", path="l3", outcome="unverified", reason="digest_lost") is None
