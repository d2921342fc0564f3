"""What every zero-copy storage backend's test module checks (Mooncake, NIXL, UMBP): the
backend's own `batch_set_v2` / `batch_get_v2` move a real host pool's pages by address, and
no digests travel with them. A page read back is counted on `l3` as `unverified`
(`digest_lost`), its load likewise, never a finding; a page the store did not hold counts
nothing; a page only stored keeps its host row's digests, so the row's next load is verified.

Each module builds its backend over the pool whose rows `HOST_ROWS` were backed up (their
digests kept) and passes how it loads them back (`load(pool)`)."""

from __future__ import annotations

from .conftest import LAYERS, host_row, page_indices
from .test_restore_pools import HOST_ROWS, findings, settle
from .test_restore_storage_tier import assert_load_unverified

POOL = "deepseek_v4_c4_indexer"


def transfer(rows, keys):
    """One `PoolTransfer` of the DeepSeek-V4 C4 indexer pool's host rows `rows` under `keys`."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    return [PoolTransfer(name=PoolName.DEEPSEEK_V4_C4_INDEXER, host_indices=page_indices(rows), keys=keys)]


def read_back_is_counted_l3_unverified(env, pool, backend, load, key: str) -> None:
    assert backend.batch_set_v2(transfer([5], [key]))[POOL] == [True]
    kept = [host_row(pool, 5, layer).clone() for layer in range(LAYERS)]
    for layer in range(LAYERS):
        host_row(pool, 5, layer).zero_()  # evicted and reused
    assert backend.batch_get_v2(transfer([5], [key]))[POOL] == [True]
    assert all(host_row(pool, 5, layer).equal(kept[layer]) for layer in range(LAYERS))  # the store put it back
    assert_load_unverified(env, pool, load)  # row 5 on l3 and at its load, once each; row 2 compared


def a_miss_counts_nothing(env, backend, key: str) -> None:
    assert backend.batch_get_v2(transfer([5], [key]))[POOL] == [False]
    settle(env)
    assert env.value("coverage_bytes", path="l3", outcome="unverified", reason="digest_lost") is None


def only_stored_keeps_the_rows_digests(env, pool, backend, load, keys: list[str]) -> None:
    assert backend.batch_set_v2(transfer(HOST_ROWS, keys))[POOL] == [True] * len(HOST_ROWS)
    load(pool)
    settle(env)
    assert findings(env) == []
    assert env.value("rooms_verified", stage="hicache_load", verdict="match") == 1
    assert env.value("coverage_bytes", path="hicache_load", outcome="verified", reason="none") == (
        len(HOST_ROWS) * LAYERS * pool.item_bytes)
