"""A load is compared once every layer of the pool is in, in whatever order SGLang loads
them. SGLang 0.5.23 loads a layer packed after a pool's target layers (an MTP draft
layer, `HybridCacheController._l2_load_transfers`) at the series' first step: a load
digested when the pool's last layer id arrived compared pages whose other layers still
held what they held before, a mismatch nobody made on clean traffic."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from . import conftest
from .conftest import PAGE, host_row, page_indices
from .test_restore_pools import DEVICE_ROWS, HOST_ROWS, STAGE, backup, findings, load, settle

NEW_ROWS = [3, 7]
LAYERS = 5  # the pool's layers here: enough for orders that differ


@pytest.fixture
def pool(make_pool, monkeypatch):
    """SGLang's DeepSeek-V4 fp8 index-K host pool of LAYERS layers."""
    monkeypatch.setattr(conftest, "LAYERS", LAYERS)
    pool = make_pool("fp8_indexer")
    assert pool.layer_num == LAYERS
    return pool


ORDERS = {
    "ascending": list(range(LAYERS)),
    "last layer first": [LAYERS - 1, *range(LAYERS - 1)],
    "reversed": list(reversed(range(LAYERS))),
    "shuffled": random.Random(3).sample(range(LAYERS), LAYERS),
}


@pytest.mark.parametrize("order", ORDERS)
def test_a_clean_load_in_any_layer_order_is_one_match(hicache, pool, order):
    env = hicache()
    backup(pool)
    load(pool, device_rows=NEW_ROWS, layers=ORDERS[order])
    settle(env)
    assert findings(env) == []
    assert env.value("rooms_verified", stage=STAGE, verdict="match") == 1
    assert env.value("rooms_verified", stage=STAGE, verdict="mismatch") == 0
    row = LAYERS * pool.item_bytes
    assert env.value("coverage_bytes", path="hicache_load", outcome="verified", reason="none") == 2 * row


@pytest.mark.parametrize("order", ORDERS)
def test_a_changed_host_row_is_found_whatever_the_layer_order(hicache, pool, order):
    env = hicache()
    backup(pool)
    host_row(pool, 2, 1)[5] ^= 0x01  # a payload byte of host row 2, layer 1: loaded after the last layer id but one
    load(pool, device_rows=NEW_ROWS, layers=ORDERS[order])
    settle(env)
    (found,) = findings(env)
    assert [(c["pool_layer"], c["host_row"], c["device_page"], c["segment"]) for c in found["cells"]] == [
        (1, 2, 3, "payload")]


@pytest.mark.parametrize("next_order", ["ascending", "last layer first"])
def test_a_load_that_stops_before_every_layer_is_in_is_never_compared(hicache, pool, next_order):
    """Its pages are not complete: compared, the layers never loaded would read as a mismatch.
    The next load (its first layer one the stopped load put in) is compared once all of its own are in."""
    env = hicache()
    backup(pool)
    load(pool, device_rows=NEW_ROWS, layers=[LAYERS - 1, 0, 1])  # the load stops here (SGLang's loop raised, say)
    settle(env)
    assert env.value("rooms_verified", stage=STAGE, verdict="match") == 0
    load(pool, device_rows=[4, 6], layers=ORDERS[next_order])
    settle(env)
    assert findings(env) == []
    assert env.value("rooms_verified", stage=STAGE, verdict="match") == 1


def test_a_load_whose_layer_calls_pass_equal_index_tensors_is_compared(hicache, pool):
    """A caller that makes the index tensors anew for each layer (equal values, other objects)."""
    env = hicache()
    backup(pool)
    for layer in range(LAYERS):
        pool.device_buffers[layer].view(torch.uint8)[NEW_ROWS] = 0
    for layer in ORDERS["last layer first"]:
        pool.load_to_device_per_layer(None, page_indices(HOST_ROWS), page_indices(NEW_ROWS), layer, "kernel")
    settle(env)
    assert findings(env) == []
    assert env.value("rooms_verified", stage=STAGE, verdict="match") == 1


# -- SGLang's own packed draft layer --------------------------------------------------------

T = 2  # target layers of the QSA indexer pool; one MTP draft layer is packed after them


def _qsa_pool(standins):
    """SGLang's `QSAIndexerPoolHost` (an indexer pool restore verification takes) with one MTP
    draft layer packed after its T target layers, random device bytes."""
    qsa = pytest.importorskip("sglang.srt.mem_cache.pool_host.qsa")
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    gen = torch.Generator().manual_seed(7)
    ratio, slot_bytes, device_pages = 4, 128, 8

    def buffers(n):
        return [torch.randint(0, 256, (device_pages * PAGE // ratio, slot_bytes), generator=gen, dtype=torch.uint8)
                for _ in range(n)]

    target = SimpleNamespace(qsa_compress_ratio=ratio, qsa_compressed_k_buffer_pool=buffers(T))
    draft = SimpleNamespace(qsa_compress_ratio=ratio, qsa_compressed_k_buffer_pool=buffers(1))
    anchor = SimpleNamespace(page_size=PAGE, page_num=8, layout="layer_first", device="cpu", pin_memory=False)
    with host_memory_budget_scope(1 << 40):
        pool = qsa.QSAIndexerPoolHost(target, anchor, mtp_draft_device_pools=(draft,))
    standins.add_pool(pool)
    return pool, target, draft


def _sglang_load_transfers(pool, target, draft, host, device):
    """The load's transfers as SGLang 0.5.23's `HybridCacheController._l2_load_transfers` makes
    them for an indexer entry with a packed draft pool: the target's, then the draft layer's."""
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer
    from sglang.srt.mem_cache.hybrid_cache.host_pool_config import with_packed_draft_layer_mapping
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
    from sglang.srt.mem_cache.pool_host.group import PoolName

    mapping = with_packed_draft_layer_mapping({layer: layer for layer in range(T)}, transfer_layer_start=T,
                                              target_device_layer_num=T, draft_layer_num=1)
    entry = build_pool_entry(name=PoolName.INDEXER, host_pool=pool, device_pool=target, layer_mapping=mapping,
                             transfer_layer_id_max=T + 1, packed_draft_device_pools=(draft,))
    controller = SimpleNamespace(mem_pool_host=SimpleNamespace(anchor_entry=None, entry_map={PoolName.INDEXER: entry}),
                                 transfer_layer_id_max=T)
    controller._l2_transfers = lambda *args: HybridCacheController._l2_transfers(controller, *args)
    empty = torch.empty(0, dtype=torch.int64)
    return HybridCacheController._l2_load_transfers(
        controller, empty, empty, [PoolTransfer(name=PoolName.INDEXER, host_indices=host, device_indices=device)])


def test_sglangs_packed_draft_layer_loaded_first_is_no_mismatch(hicache, standins):
    l2 = pytest.importorskip("sglang.srt.mem_cache.l2_transfer")
    env = hicache()
    pool, target, draft = _qsa_pool(standins)
    assert pool.layer_num == T + 1 and env.probe.restore.pool(env.probe.state_of(pool)) is not None
    engine = l2.L2TransferEngine("kernel")
    host, old, new = page_indices(HOST_ROWS), page_indices(DEVICE_ROWS), page_indices(NEW_ROWS)
    engine.submit_device_to_host([l2.L2Transfer(pool, target, host, old)])  # write-through: every packed layer
    for buffer in pool.device_buffers:
        buffer[NEW_ROWS] = 0  # the pages the prefix is restored into held something else
    transfers = _sglang_load_transfers(pool, target, draft, host, new)
    order = []
    for transfer in transfers:  # which layer SGLang's loop puts in at which step
        order += [(step, transfer.layer_mapper(step)) for step in range(T) if transfer.layer_mapper(step) is not None]
    assert sorted(order)[0] == (0, 0) and (0, T) in order  # the draft layer (the pool's last) at the first step
    engine.submit_host_to_device(transfers, transfer_layer_id_max=T)
    settle(env)
    for layer in range(T + 1):  # the restore itself is clean
        for was, now in zip(DEVICE_ROWS, NEW_ROWS):
            assert torch.equal(pool.device_buffers[layer][now], pool.device_buffers[layer][was])
    assert findings(env) == []
    assert env.value("rooms_verified", stage=STAGE, verdict="match") == 1
