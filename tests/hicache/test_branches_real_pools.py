"""Branch, page and token counters against real SGLang host pools on CPU.

Each case drives one real pool (fp8 index-K, fp4 index-K, C4 KV) in one
(layout, io_backend) pair through a fixed scenario. What SGLang really did is
observed independently of the probe, from the copy op it called (recorded by
the CPU stand-ins, see cpu_standins.py) or the error it raised; the counters
must equal those observations, and every label set used must have existed,
at zero, since the pool was built.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import sglang.srt.mem_cache.memory_pool_host as mph

from .conftest import HAS_BACKUP_TOKENS, LAYERS, PAGE, SUPPORTED, UNSUPPORTED, device_row, page_indices

POOLS = ["fp8_indexer", "fp4_indexer", "c4_kv"]
PAGE_OPS = {
    "transfer_kv_all_layer_mla", "transfer_kv_per_layer_mla", "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_direct", "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_per_layer_direct_pf_lf",
}  # fmt: skip


def observe(mem, fn):
    """Run one pool call; say which branch SGLang took, from its op call or its error."""
    before = len(mem.calls)
    try:
        fn()
        error = None
    except Exception as exc:  # the pool's own errors are part of what is observed
        error = exc
    ops = set(mem.calls[before:])
    if "transfer_cache_dsv4_mla" in ops:
        return "token_dsv4_mla", error
    if ops & PAGE_OPS:
        return "page", error
    if error is None:
        return "empty", None
    text = str(error)
    if "size mismatch" in text:
        return "size_mismatch", error
    if "Unsupported V4 paged host layout" in text:
        return "unsupported", error
    if "expects page-aligned" in text:
        return "token_rejected", error
    if isinstance(error, TypeError) and "NoneType" in text:
        # page-first layouts have no host pointer table; only the token path indexes it
        return "token_dsv4_mla", error
    raise AssertionError(f"unexpected pool error: {error!r}")


def scenario(pool, io_backend):
    """(direction, io_backend label, layers moved, numel, call) for one run."""
    host, dev = page_indices([5, 6]), page_indices([3, 7])
    few_host, few_dev = torch.arange(10, 20), torch.arange(0, 10)
    calls = [
        ("d2h", io_backend, LAYERS, 0, lambda: pool.backup_from_device_all_layer(None, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), io_backend)),
        ("d2h", io_backend, LAYERS, 0, lambda: pool.backup_from_device_all_layer(None, None, None, io_backend)),
        ("d2h", io_backend, LAYERS, 0, lambda: pool.backup_from_device_all_layer(None, host, dev[:-1], io_backend)),
        # token-granular calls first: on pools whose rows are not the C4 row they write wrong rows
        ("d2h", io_backend, LAYERS, 10, lambda: pool.backup_from_device_all_layer(None, few_host, few_dev, io_backend)),
        ("d2h", "none", LAYERS, 10, lambda: pool.backup_tokens_from_device_all_layer(few_host, few_dev)),
        ("h2d", io_backend, 1, 10, lambda: pool.load_to_device_per_layer(None, few_host, few_dev, 0, io_backend)),
        ("d2h", io_backend, LAYERS, host.numel(), lambda: pool.backup_from_device_all_layer(None, host, dev, io_backend)),
    ]  # fmt: skip
    if not HAS_BACKUP_TOKENS:  # backup_tokens_from_device_all_layer arrives in SGLang 0.5.23
        del calls[4]
    for layer in range(LAYERS):
        calls.append(("h2d", io_backend, 1, host.numel(), lambda layer=layer: pool.load_to_device_per_layer(None, host, dev, layer, io_backend)))
    return calls, host, dev


@pytest.mark.parametrize("layout,io_backend", SUPPORTED + UNSUPPORTED)
@pytest.mark.parametrize("kind", POOLS)
def test_counters_equal_branches_taken(hicache, make_pool, standins, kind, layout, io_backend):
    env = hicache()
    pool = make_pool(kind, layout)
    name = pool.pool_name
    zero_at_start = env.samples("hicache_copies", pool=name)

    calls, host, dev = scenario(pool, io_backend)
    taken, pages, tokens = Counter(), Counter(), Counter()
    wiped = False
    for direction, label, layers, numel, call in calls:
        if direction == "h2d" and numel == host.numel() and not wiped:  # page loads must restore the bytes
            expected = {(r, l): device_row(pool, r, l).clone() for r in (3, 7) for l in range(LAYERS)}
            for l in range(LAYERS):
                pool.device_buffers[l].view(torch.uint8)[[3, 7]] = 0
            wiped = True
        branch, error = observe(standins, call)
        taken[(direction, label, branch)] += 1
        if error is None and branch == "page":
            pages[direction] += numel // PAGE * layers
        if error is None and branch in ("page", "token_dsv4_mla"):
            tokens[direction] += numel * layers

    counted = env.samples("hicache_copies", pool=name, layout=layout)
    for (direction, label, branch), n in taken.items():
        key = (("branch", branch), ("direction", direction), ("io_backend", label))
        assert counted.get(key) == n, (key, counted)
        assert zero_at_start.get(key + (("layout", layout),)) == 0.0, f"{key} did not exist at zero"
    assert sum(counted.values()) == sum(taken.values())
    for direction in ("d2h", "h2d"):
        assert env.value("hicache_pages", pool=name, direction=direction) == pages[direction]
        assert env.value("hicache_tokens", pool=name, direction=direction) == tokens[direction]

    if (layout, io_backend) in SUPPORTED:
        assert taken[("d2h", io_backend, "page")] == 1
        for (r, l), want in expected.items():
            assert torch.equal(device_row(pool, r, l), want), f"row {r} layer {l} not restored"
    else:
        assert taken[("d2h", io_backend, "unsupported")] == 1


def test_inner_token_call_of_a_backup_is_counted_once(hicache, make_pool, standins):
    """From 0.5.23 backup_from_device_all_layer calls backup_tokens_from_device_all_layer
    on unaligned input; both are wrapped, only the outer call counts (before 0.5.23
    it calls the token kernel itself: one call, counted once)."""
    env = hicache()
    pool = make_pool("fp8_indexer")
    pool.backup_from_device_all_layer(None, torch.arange(10, 20), torch.arange(0, 10), "kernel")
    assert standins.calls.count("transfer_cache_dsv4_mla") == 1
    counted = env.samples("hicache_copies", pool=pool.pool_name)
    assert sum(counted.values()) == 1
    assert env.value("hicache_copies", pool=pool.pool_name, direction="d2h", io_backend="kernel",
                     layout="layer_first", branch="token_dsv4_mla") == 1  # fmt: skip


@pytest.mark.skipif(not hasattr(mph.DeepSeekV4PagedHostPool, "backup_from_device_all_layer_physical"),
                    reason="the *_physical entry points arrive in SGLang 0.5.21 (before, L2TransferEngine "
                    "calls the wrapped methods itself)")
def test_physical_entry_points_dispatch_through_the_wrappers(hicache, make_pool, standins):
    """L2TransferEngine calls the *_physical methods, which are not wrapped; each
    transfer is still counted exactly once through the wrapped methods."""
    import sglang.srt.mem_cache.l2_transfer as l2

    env = hicache()
    pool = make_pool("fp8_indexer")
    host, dev = page_indices([0, 2]), page_indices([4, 5])
    if l2.device_module is torch.cpu:  # the engine runs on a CPU build (0.5.22+)
        engine = l2.L2TransferEngine("kernel")
        engine.submit_device_to_host([l2.L2Transfer(pool, None, host, dev)])
        engine.submit_host_to_device([l2.L2Transfer(pool, None, host, dev)], transfer_layer_id_max=LAYERS)
    else:  # 0.5.21: its streams need an accelerator; the calls its submits make, in their order
        pool.backup_from_device_all_layer_physical(None, host, dev, "kernel")
        for layer in range(LAYERS):
            pool.load_to_device_per_layer_physical(None, host, dev, layer, "kernel", is_draft=False)
    labels = dict(pool=pool.pool_name, io_backend="kernel", layout="layer_first", branch="page")
    assert env.value("hicache_copies", direction="d2h", **labels) == 1
    assert env.value("hicache_copies", direction="h2d", **labels) == LAYERS
    assert env.value("hicache_pages", pool=pool.pool_name, direction="d2h") == 2 * LAYERS
    assert env.value("hicache_pages", pool=pool.pool_name, direction="h2d") == 2 * LAYERS


def test_pools_built_before_install_are_registered_on_first_call(make_pool, hicache, standins):
    pool = make_pool("fp4_indexer")
    env = hicache()
    assert env.samples("hicache_copies", pool=pool.pool_name) == {}
    pool.backup_from_device_all_layer(None, page_indices([0]), page_indices([1]), "direct")
    counted = env.samples("hicache_copies", pool=pool.pool_name)
    assert counted[(("branch", "page"), ("direction", "d2h"), ("io_backend", "direct"), ("layout", "layer_first"))] == 1
    assert len(counted) > 1  # the zero series came with the late registration


def test_counts_of_a_pool_freed_before_the_flush_are_still_published(hicache, make_pool, standins):
    import gc

    env = hicache()
    pool = make_pool("c4_kv")
    pool.backup_from_device_all_layer(None, page_indices([0]), page_indices([1]), "kernel")
    del pool
    gc.collect()
    assert env.value("hicache_copies", pool="deepseek_v4_c4", direction="d2h", io_backend="kernel",
                     layout="layer_first", branch="page") == 1  # fmt: skip
