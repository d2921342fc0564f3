"""The token-path geometry guard on real pools.

The token kernel (here its CPU stand-in, cpu_standins.py) addresses every
buffer as C4 latent pages: token t -> page t >> 6, slot t & 63, value at
page * 37440 + slot * 576, scale at page * 37440 + 36864 + slot * 8. On the
fp8 index-K pool (8448-byte rows) SGLang 0.5.23 lets calls reach it.
"""

from __future__ import annotations

import logging

import pytest
import torch

from dsv4_idxk_probe.hicache import GuardRefused

from .conftest import HAS_BACKUP_TOKENS, LAYERS

C4_PAGE, C4_VALUE, C4_SCALE, C4_SCALE_AT = 37440, 576, 8, 36864


def c4_byte_ranges(tokens):
    """Byte ranges the C4 geometry writes for these destination tokens."""
    out = []
    for t in tokens:
        page, slot = t >> 6, t & 63
        out.append((page * C4_PAGE + slot * C4_VALUE, C4_VALUE))
        out.append((page * C4_PAGE + C4_SCALE_AT + slot * C4_SCALE, C4_SCALE))
    return out


def changed_rows(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    return set(torch.nonzero((before != after).any(dim=1)).flatten().tolist())


def test_token_path_on_fp8_indexer_writes_wrong_rows_and_is_counted(hicache, make_pool, standins, caplog):
    env = hicache(guard="observe")
    pool = make_pool("fp8_indexer")
    assert getattr(pool, "page_aligned_only", False) is False  # SGLang's region helper's choice (no flag before 0.5.20)
    host_tokens, device_tokens = list(range(10, 20)), list(range(0, 10))
    before = [pool.kv_buffer[l].clone() for l in range(LAYERS)]
    caplog.set_level(logging.ERROR, logger="dsv4_idxk_probe.test.hicache")

    pool.backup_from_device_all_layer(None, torch.tensor(host_tokens), torch.tensor(device_tokens), "kernel")

    item = pool.item_bytes
    want_rows = {off // item for off, n in c4_byte_ranges(host_tokens)} | {
        (off + n - 1) // item for off, n in c4_byte_ranges(host_tokens)
    }
    for l in range(LAYERS):
        assert changed_rows(before[l], pool.kv_buffer[l]) == want_rows
        flat_host, flat_dev = pool.kv_buffer[l].view(-1), pool.device_buffers[l].view(-1)
        for (dst, n), (src, _) in zip(c4_byte_ranges(host_tokens), c4_byte_ranges(device_tokens)):
            assert torch.equal(flat_host[dst : dst + n], flat_dev[src : src + n])
    # the 10 tokens belong to host page 0 of this pool, but row 4 was written too
    assert 4 in want_rows
    assert env.value("hicache_guard", pool=pool.pool_name, action="observed") == 1
    guard = [r for r in env.records if r.get("event") == "guard"]
    assert len(guard) == 1 and guard[0]["pool"] == pool.pool_name and guard[0]["kind"] == "hicache"
    assert "test_guard.py" in guard[0]["stack"]  # the caller is named in the stack
    assert any(pool.pool_name in r.getMessage() and "test_guard.py" in r.getMessage() for r in caplog.records)


def test_full_token_ids_on_fp8_indexer_go_out_of_bounds(hicache, make_pool, standins):
    hicache(guard="observe")
    pool = make_pool("fp8_indexer")
    full = torch.arange(768, 778)  # FULL token ids, as the HiCache stack hands them out
    pool.backup_from_device_all_layer(None, full, full, "kernel")
    assert standins.out_of_bounds, "the C4 geometry should address past the 8448-byte-row buffers"


@pytest.mark.parametrize("direction", ["backup", "load", pytest.param("backup_tokens", marks=pytest.mark.skipif(
    not HAS_BACKUP_TOKENS, reason="backup_tokens_from_device_all_layer arrives in SGLang 0.5.23"))])
def test_block_refuses_before_any_byte_is_written(hicache, make_pool, standins, direction):
    env = hicache(guard="block")
    pool = make_pool("fp8_indexer")
    host_before = [pool.kv_buffer[l].clone() for l in range(LAYERS)]
    dev_before = [b.clone() for b in pool.device_buffers]
    host, dev = torch.arange(10, 20), torch.arange(0, 10)
    calls = {
        "backup": lambda: pool.backup_from_device_all_layer(None, host, dev, "kernel"),
        "load": lambda: pool.load_to_device_per_layer(None, host, dev, 1, "kernel"),
        "backup_tokens": lambda: pool.backup_tokens_from_device_all_layer(host, dev),
    }
    with pytest.raises(GuardRefused, match="deepseek_v4_c4_indexer.*hicache.guard"):
        calls[direction]()
    assert "transfer_cache_dsv4_mla" not in standins.calls
    assert all(torch.equal(a, b) for a, b in zip(host_before, pool.kv_buffer))
    assert all(torch.equal(a, b) for a, b in zip(dev_before, pool.device_buffers))
    assert env.value("hicache_guard", pool=pool.pool_name, action="blocked") == 1


def test_block_leaves_page_copies_alone(hicache, make_pool, standins):
    env = hicache(guard="block")
    pool = make_pool("fp8_indexer")
    from .conftest import page_indices

    pool.backup_from_device_all_layer(None, page_indices([0]), page_indices([2]), "kernel")
    assert torch.equal(pool.kv_buffer[0][0], pool.device_buffers[0][2])
    assert env.value("hicache_guard", pool=pool.pool_name, action="blocked") == 0


def test_hisparse_c4_pool_is_the_kernels_own_geometry(hicache, make_pool, standins):
    """The pool the token kernel was written for: copies land right, no guard.
    HiSparse backs up through backup_tokens_from_device_all_layer from 0.5.23,
    through backup_from_device_all_layer(..., io_backend="kernel") before."""
    env = hicache(guard="block")
    pool = make_pool("hisparse_c4")
    host, dev = [5, 70, 130], [3, 64, 200]
    if HAS_BACKUP_TOKENS:
        pool.backup_tokens_from_device_all_layer(torch.tensor(host), torch.tensor(dev))
        io_backend = "none"
    else:
        pool.backup_from_device_all_layer(None, torch.tensor(host), torch.tensor(dev), "kernel")
        io_backend = "kernel"
    for l in range(LAYERS):
        flat_host, flat_dev = pool.kv_buffer[l].view(-1), pool.device_buffers[l].view(-1)
        for (dst, n), (src, _) in zip(c4_byte_ranges(host), c4_byte_ranges(dev)):
            assert torch.equal(flat_host[dst : dst + n], flat_dev[src : src + n])
    assert not standins.out_of_bounds
    assert env.value("hicache_copies", pool="dsv4_hisparse_c4", direction="d2h", io_backend=io_backend,
                     layout="layer_first", branch="token_dsv4_mla") == 1  # fmt: skip
    assert env.value("hicache_guard", pool="dsv4_hisparse_c4", action="blocked") is None


def test_c4_kv_pool_with_full_pages_is_guarded(hicache, make_pool, standins):
    """C4 KV rows are the kernel's rows, but in the HiCache stack its indices are
    FULL tokens over 256-token pages, which the kernel would read as C4 slots."""
    env = hicache(guard="observe")
    pool = make_pool("c4_kv")
    pool.backup_from_device_all_layer(None, torch.arange(0, 10), torch.arange(0, 10), "kernel")
    assert env.value("hicache_guard", pool="deepseek_v4_c4", action="observed") == 1
    (record,) = [r for r in env.records if r.get("event") == "guard"]
    assert any("page_size 256" in reason for reason in record["reasons"])
