"""The storage tier through a zero-copy backend: SGLang's own `MooncakeStore` methods on a real
Mooncake store (its `mooncake_master` on loopback, TCP), moving a real host pool's pages by
address. The cases are every zero-copy backend's (`zero_copy_cases`)."""

from __future__ import annotations

import inspect
import os
import time

import pytest

from dsv4_idxk_probe.testbed.sglang.mooncake_master import MasterError, MooncakeMaster, running_master

from . import zero_copy_cases as cases
from .test_restore_pools import backup, load, settle


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


def _key(name: str) -> str:
    """A key no earlier test stored: the master lives as long as the module."""
    return f"{name}-{os.getpid()}-{time.monotonic_ns()}"


def test_a_page_read_back_through_mooncake_is_counted_l3_unverified_and_never_a_finding(backed_up):
    env, pool, backend = backed_up
    cases.read_back_is_counted_l3_unverified(env, pool, backend, load, _key("page-5"))


def test_a_page_mooncake_does_not_hold_counts_nothing_on_l3(backed_up):
    env, _pool, backend = backed_up
    cases.a_miss_counts_nothing(env, backend, _key("absent"))


def test_a_page_only_stored_in_mooncake_keeps_its_digests_and_its_load_is_verified(backed_up):
    env, pool, backend = backed_up
    cases.only_stored_keeps_the_rows_digests(env, pool, backend, load, [_key("p2"), _key("p5")])
