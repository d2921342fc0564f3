"""The storage tier through SGLang's UMBP store (`UMBPStore`, ROCm's unified memory buffer
pool): SGLang's own `batch_get_v2` / `batch_set_v2` moving a real host pool's pages by address.

UMBP's client (`mori`'s UMBP library) cannot be installed here, so the client is a **fake**:
`FakeUMBPClient`, an in-process dict that copies each object from and to the addresses SGLang
hands it, as the real client's `batch_put_from_ptr` / `batch_get_into_ptr` do. The store's
own code (key expansion, buffer addresses from the pool, results per page) is SGLang's. The
host pool is `page_first_direct` (one address per page: UMBP's v2 path refuses a multi-layer
`layer_first` pool, whose pages are one address per layer).

The cases are every zero-copy backend's (`zero_copy_cases`)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from . import zero_copy_cases as cases
from .conftest import LAYERS, page_indices
from .test_restore_pools import DEVICE_ROWS, HOST_ROWS, settle


class FakeUMBPClient:
    """A fake of UMBP's client (not installable here): objects kept in a dict, moved by address."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}

    def batch_put_from_ptr(self, keys, ptrs, sizes):
        for key, ptr, size in zip(keys, ptrs, sizes):
            self.objects[key] = ctypes.string_at(ptr, size)
        return [True] * len(keys)

    def batch_get_into_ptr(self, keys, ptrs, sizes):
        found = []
        for key, ptr, size in zip(keys, ptrs, sizes):
            data = self.objects.get(key)
            if data is not None and len(data) == size:
                ctypes.memmove(ptr, data, size)
            found.append(data is not None and len(data) == size)
        return found


def umbp_backend(pool):
    """SGLang's UMBPStore, its methods as shipped, holding the fake client and the pool
    registered as the hybrid stack registers it (its __init__ wants the real client)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.storage.umbp.umbp_store import UMBPStore

    backend = object.__new__(UMBPStore)
    backend.__dict__.update(client=FakeUMBPClient(), registered_pools={PoolName.DEEPSEEK_V4_C4_INDEXER: pool},
                            config_prefix=None, mla_suffix="0", mha_suffix="0", is_mla_backend=True)
    return backend


def _load(pool):
    for layer in range(LAYERS):
        pool.device_buffers[layer].view(torch.uint8)[DEVICE_ROWS] = 0  # the pages held something else
    for layer in range(LAYERS):
        pool.load_to_device_per_layer(None, page_indices(HOST_ROWS), page_indices(DEVICE_ROWS), layer, "direct")


@pytest.fixture
def backed_up(hicache, make_pool):
    """A page_first_direct pool's device pages backed up to host rows 2 and 5, their digests
    kept, and SGLang's UMBPStore over it."""
    env = hicache()
    pool = make_pool("fp8_indexer", "page_first_direct")
    pool.backup_from_device_all_layer(None, page_indices(HOST_ROWS), page_indices(DEVICE_ROWS), "direct")
    settle(env)
    return env, pool, umbp_backend(pool)


def test_a_page_read_back_through_umbp_is_counted_l3_unverified_and_never_a_finding(backed_up):
    env, pool, backend = backed_up
    cases.read_back_is_counted_l3_unverified(env, pool, backend, _load, "page-5")


def test_a_page_umbp_does_not_hold_counts_nothing_on_l3(backed_up):
    env, _pool, backend = backed_up
    cases.a_miss_counts_nothing(env, backend, "absent")


def test_a_page_only_stored_through_umbp_keeps_its_digests_and_its_load_is_verified(backed_up):
    env, pool, backend = backed_up
    cases.only_stored_keeps_the_rows_digests(env, pool, backend, _load, ["p2", "p5"])
