"""SGLang 0.5.23's direct external linker (``--enable-unified-cache-external-linker``) loads
index-K from the storage tier straight into device pages, with no host pool between: the
probe counts each queued load ``l3``/``unverified``/``direct_linker`` with its index-K bytes.

Real parts: SGLang's DeepSeek-V4 pools (V4 and V4.1 shapes), its own linker pool group
(`_build_deepseek_v4_device_pool_group`), `PoolTransfer`, and the real
`MooncakeDirectLinker.load` / `UMBPDirectLinker.load` patched from the shipped target table.
The linker objects are made without their __init__ (no Mooncake store or UMBP client can
run here): `load` only resolves the transfers and queues them, which is what is counted."""

from __future__ import annotations

import pytest
import torch

import pdworld
import v41world
from pd_testkit import make_runtime

linker_module = pytest.importorskip("sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler",
                                    reason="the direct external linker arrives in SGLang 0.5.23")

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_direct_linker import MooncakeDirectLinker  # noqa: E402
from sglang.srt.mem_cache.storage.umbp.umbp_direct_linker import UMBPDirectLinker  # noqa: E402

from dsv4_idxk_probe.sglang.patcher import Patcher  # noqa: E402
from dsv4_idxk_probe.sglang.targets import load_targets  # noqa: E402

COVERAGE = "dsv4_idxk_probe_coverage_bytes_total"


@pytest.fixture
def patched(published):
    runtime, _sink, registry = make_runtime()
    patcher = Patcher(runtime, [t for t in load_targets(["sglang"]) if t.name.startswith("linker.")], route="wrapt")
    status = patcher.patch()
    assert {name: s for name, (s, _) in status.items()} == {"linker.mooncake_load": "patched",
                                                            "linker.umbp_load": "patched"}
    yield runtime, registry
    patcher.unpatch()
    runtime.close()


def _counted(registry) -> dict[tuple[str, str, str], float]:
    return {(s.labels["path"], s.labels["outcome"], s.labels["reason"]): s.value for f in registry.collect()
            for s in f.samples if s.name == COVERAGE and s.value}


def _index_k_page_bytes(pool) -> int:
    """Index-K bytes of one full page, from the pool's own buffers: each index pool's rows
    of that page (a low-ratio pool keeps 256 / (ratio x slots) rows per page) over its layers."""
    total = 0
    for ratio, index_pool in pool.index_pools.items():
        rows = pool.page_size // (ratio * int(index_pool.page_size))
        total += sum(rows * buffer[0].nbytes for buffer in index_pool.index_k_with_scale_buffer)
    return total


@pytest.mark.parametrize("linker_class", [MooncakeDirectLinker, UMBPDirectLinker])
@pytest.mark.parametrize("world", [pdworld, v41world], ids=["v4", "v41"])
def test_a_direct_linker_load_counts_its_index_k_bytes_unverified(patched, linker_class, world):
    runtime, registry = patched
    made = world.make_pool(seed=1)
    pool = getattr(made[0] if isinstance(made, tuple) else made, "pool", made[0] if isinstance(made, tuple) else made)
    group = linker_module._build_deepseek_v4_device_pool_group(pool, pool.page_size)
    linker = pdworld.standin(linker_class, pool_group=group, pending_loads={}, _pending={})  # each one's queue
    pages = 3
    load = [PoolTransfer(name=PoolName.KV, device_indices=torch.arange(pages * pool.page_size),
                         keys=[f"page-{k}" for k in range(pages)])]
    queued = linker.load("rid-1", load)
    assert queued is True
    assert _counted(registry) == {("l3", "unverified", "direct_linker"): pages * _index_k_page_bytes(pool)}
    # a load SGLang does not queue (no storage keys: nothing to restore) counts nothing more
    assert linker.load("rid-2", [PoolTransfer(name=PoolName.KV, device_indices=torch.arange(8), keys=[])]) is False
    assert _counted(registry) == {("l3", "unverified", "direct_linker"): pages * _index_k_page_bytes(pool)}
