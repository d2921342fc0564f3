"""Construction invariants and the one-line pool description."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import sglang.srt.mem_cache.memory_pool_host as mph
from dsv4_idxk_probe.hicache.geometry import INVARIANTS

from .conftest import HOST_PAGES, LAYERS, PAGE, accepted, host_memory_budget_scope, indexer_region, page_indices


def build(standins, buffers, item_bytes, name="probe_test_pool", page_aligned_only=False):
    with host_memory_budget_scope(1 << 40):
        pool = mph.DeepSeekV4PagedHostPool(**accepted(
            mph.DeepSeekV4PagedHostPool, pool_name=name, device_buffers=buffers, item_bytes=item_bytes,
            num_host_pages=HOST_PAGES, slot_page_size=PAGE, layout="layer_first", device="cpu", pin_memory=False,
            page_aligned_only=page_aligned_only,
        ))  # fmt: skip
    standins.add_pool(pool)
    return pool


def failed(env, name):
    return {i for i in INVARIANTS if env.value("hicache_invariant_violations", pool=name, invariant=i)}


@pytest.mark.parametrize("kind", ["fp8_indexer", "fp4_indexer", "c4_kv", "hisparse_c4"])
def test_real_pools_pass(hicache, make_pool, kind):
    env = hicache()
    pool = make_pool(kind)
    assert failed(env, pool.pool_name) == set()
    assert all(env.value("hicache_invariant_violations", pool=pool.pool_name, invariant=i) == 0 for i in INVARIANTS)


def test_a_3d_bf16_index_k_buffer_gets_the_wrong_item_bytes_and_is_flagged(hicache, standins):
    """A bf16 index-K patch with a [pages, 64, 128] buffer: SGLang's region helper
    then takes shape[1] * 2 = 128 bytes as the row, and page copies move the wrong 128 bytes."""
    env = hicache()
    buffers = [torch.randint(0, 256, (20, 64, 256), dtype=torch.uint8).view(torch.bfloat16) for _ in range(LAYERS)]
    name, device_buffers, item_bytes, _, aligned_only = indexer_region(SimpleNamespace(index_k_with_scale_buffer=buffers))
    pool = build(standins, device_buffers, item_bytes, name, aligned_only)
    assert failed(env, pool.pool_name) == {"row_bytes_mismatch"}
    pool.backup_from_device_all_layer(None, page_indices([0]), page_indices([1]), "kernel")
    # the kernel steps device rows by item_bytes: "page 1" is bytes 128..255 of page 0
    flat = buffers[0].view(torch.uint8).reshape(-1)
    assert torch.equal(pool.kv_buffer[0][0], flat[item_bytes : 2 * item_bytes])


def test_non_contiguous_device_buffer(hicache, standins):
    env = hicache()
    buffers = [torch.zeros(20, 2 * 8448, dtype=torch.uint8)[:, :8448] for _ in range(LAYERS)]
    pool = build(standins, buffers, 8448)
    assert failed(env, pool.pool_name) == {"device_not_contiguous"}


def test_item_bytes_not_a_multiple_of_8(hicache, standins):
    env = hicache()
    pool = build(standins, [torch.zeros(20, 8452, dtype=torch.uint8) for _ in range(LAYERS)], 8452)
    assert failed(env, pool.pool_name) == {"item_bytes_not_multiple_of_8"}


def test_layers_that_differ(hicache, standins):
    env = hicache()
    pool = build(standins, [torch.zeros(20, 8448, dtype=torch.uint8), torch.zeros(21, 8448, dtype=torch.uint8)], 8448)
    assert failed(env, pool.pool_name) == {"layer_buffers_differ"}


def test_one_line_per_pool_and_an_info_series(hicache, make_pool, caplog):
    caplog.set_level(logging.INFO, logger="dsv4_idxk_probe.test.hicache")
    env = hicache()
    pool = make_pool("fp8_indexer", "page_first")
    rows = pool.device_buffers[0].shape[0]  # 20 on 0.5.23; the release sizes its indexer pool
    (line,) = [r.getMessage() for r in caplog.records if "hicache pool deepseek_v4_c4_indexer" in r.getMessage()]
    for part in ("layers=2", "item_bytes=8448", "page_size=256", f"host_pages={HOST_PAGES}", "layout=page_first",
                 "page_aligned_only=False", f"[{rows}, 8448] uint8", "token_path_eligible=True", "token_row_matches=False"):  # fmt: skip
        assert part in line, (part, line)
    assert env.value("hicache_pool_info", pool=pool.pool_name, layout="page_first", page_aligned_only="false",
                     token_path_eligible="true") == 1  # fmt: skip
    (record,) = [r for r in env.records if r.get("event") == "pool"]
    assert record["device_shape"] == [rows, 8448] and record["invariants_failed"] == {}


def test_a_pool_without_the_page_aligned_only_flag_reads_as_not_aligned_only(make_pool):
    """SGLang 0.5.18-0.5.19 pools have no `page_aligned_only` (they take every unaligned
    copy to the token path); reading it failed the pool's registration there."""
    from dsv4_idxk_probe.sglang.hicache import pool_geometry

    pool = make_pool("fp8_indexer")
    if hasattr(pool, "page_aligned_only"):
        del pool.page_aligned_only
    assert pool_geometry(pool).page_aligned_only is False
