"""Installing and removing the wrappers, and staying out of SGLang's way."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import wrapt

import sglang.srt.mem_cache.memory_pool_host as mph

from dsv4_idxk_probe import safety
from dsv4_idxk_probe.hicache import HiCacheConfigError, parse_settings

from .conftest import Env, LAYERS, hicache_targets, page_indices

Pool = mph.DeepSeekV4PagedHostPool
#: The copy methods the release under test has (backup_tokens_* arrives in SGLang 0.5.23).
METHODS = ["backup_from_device_all_layer", "load_to_device_per_layer", "backup_tokens_from_device_all_layer"]
METHODS = [m for m in METHODS if hasattr(Pool, m)]


def wrapped(name: str) -> bool:
    return isinstance(Pool.__dict__[name], wrapt.FunctionWrapper)


def page_copies(env, pool) -> float:
    return env.value("hicache_copies", pool=pool.pool_name, direction="d2h", io_backend="kernel",
                     layout="layer_first", branch="page") or 0.0  # fmt: skip


def test_target_table_names_the_three_copy_methods_and_not_the_physical_ones():
    qualnames = {t["qualname"] for t in hicache_targets()}
    assert {f"DeepSeekV4PagedHostPool.{m}" for m in METHODS} <= qualnames
    assert not any("physical" in q for q in qualnames)
    for target in hicache_targets():  # every declared parameter is really there, in order
        owner, method = target["qualname"].split(".")
        fn = getattr(importlib.import_module(target["module"]), owner).__dict__[method]
        assert list(inspect.signature(fn).parameters)[: len(target["params"])] == target["params"]


def test_install_uninstall_install(make_pool, standins):
    """install -> count; uninstall -> originals back, nothing counted; install again -> count."""
    env = Env({"flush_interval_s": 3600.0})
    signatures = {m: inspect.signature(getattr(Pool, m)) for m in METHODS}
    try:
        env.install()
        assert all(wrapped(m) for m in METHODS)
        assert {m: inspect.signature(getattr(Pool, m)) for m in METHODS} == signatures
        pool = make_pool("fp8_indexer")
        pool.backup_from_device_all_layer(None, page_indices([0]), page_indices([1]), "kernel")
        assert page_copies(env, pool) == 1

        env.uninstall()
        assert not any(wrapped(m) for m in METHODS)
        pool.backup_from_device_all_layer(None, page_indices([0]), page_indices([1]), "kernel")
        assert page_copies(env, pool) == 1

        again = Env({"flush_interval_s": 3600.0})
        again.install()
        try:
            pool.backup_from_device_all_layer(None, page_indices([0]), page_indices([1]), "kernel")
            assert page_copies(again, pool) == 1
            assert not isinstance(Pool.__dict__[METHODS[0]].__wrapped__, wrapt.FunctionWrapper)  # not double wrapped
        finally:
            again.uninstall()
    finally:
        env.uninstall()
    assert not any(wrapped(m) for m in METHODS)


def test_sglang_errors_pass_through_unchanged(hicache, make_pool, standins):
    hicache()
    pool = make_pool("fp8_indexer")
    with pytest.raises(ValueError, match=r"transfer index size mismatch: host=256, device=255"):
        pool.backup_from_device_all_layer(None, page_indices([0]), page_indices([1])[:-1], "kernel")
    with pytest.raises(ValueError, match="Unsupported V4 paged host layout/backend: layer_first/bogus"):
        pool.backup_from_device_all_layer(None, page_indices([0]), page_indices([1]), "bogus")


def _copy_round_trip(pool):
    host, dev = page_indices([3]), page_indices([4])
    pool.backup_from_device_all_layer(None, host, dev, "kernel")
    for l in range(LAYERS):
        pool.device_buffers[l].view(torch.uint8)[4] = 0
    for layer in range(LAYERS):
        pool.load_to_device_per_layer(None, host, dev, layer, "kernel")
    return host_bytes_equal(pool)


def host_bytes_equal(pool):
    return all(torch.equal(pool.kv_buffer[l][3], pool.device_buffers[l][4]) for l in range(LAYERS))


def grown(before, site):
    return safety.error_counts().get(site, 0) > before.get(site, 0)


def test_broken_metrics_never_break_the_copy(hicache, make_pool, standins, monkeypatch):
    env = hicache(roundtrip=True)
    env.allow_probe_errors = True

    class Broken:
        def labels(self, **_):
            raise RuntimeError("metrics backend down")

    for name in ("hicache_copies", "hicache_pages", "hicache_tokens", "hicache_pool_info"):
        monkeypatch.setattr(env.runtime.metrics, name, Broken())
    before = safety.error_counts()
    pool = make_pool("fp8_indexer")  # registration fails inside the probe
    assert _copy_round_trip(pool)
    env.probe.flush()
    assert grown(before, "hicache.pool_init")
    assert id(pool) in env.probe.unusable  # not registered: its copies pass straight through from now on


def test_a_failing_probe_call_never_breaks_the_copy(hicache, make_pool, standins, monkeypatch):
    env = hicache()
    env.allow_probe_errors = True
    pool = make_pool("fp8_indexer")

    def boom(*_a, **_k):
        raise RuntimeError("probe bug")

    for method in ("begin", "end"):
        with monkeypatch.context() as patch:
            patch.setattr(env.probe, method, boom)
            before = safety.error_counts()
            assert _copy_round_trip(pool)
            assert grown(before, "hicache.backup") and grown(before, "hicache.load")


def test_disabled_probe_counts_nothing(hicache, make_pool, standins):
    env = hicache(enabled=False, guard="block")
    pool = make_pool("fp8_indexer")
    pool.backup_from_device_all_layer(None, torch.arange(10, 20), torch.arange(0, 10), "kernel")  # not refused
    assert "transfer_cache_dsv4_mla" in standins.calls
    assert env.samples("hicache_copies") == {}


@pytest.mark.parametrize(
    "section,field",
    [
        ({"guard": "warn"}, "hicache.guard"),
        ({"roundtrip": "yes"}, "hicache.roundtrip"),
        ({"flush_interval_s": 0}, "hicache.flush_interval_s"),
        ({"index_queue_max": 0}, "hicache.index_queue_max"),
        ({"io_backends": "kernel"}, "hicache.io_backends"),
        ({"gaurd": "block"}, "unknown key(s) ['gaurd']"),
    ],
)
def test_bad_config_names_the_field(section, field):
    with pytest.raises(HiCacheConfigError) as info:
        parse_settings(section)
    assert field in str(info.value)


def test_bad_config_is_refused_when_the_wrappers_are_built():
    env = Env({"guard": "warn"})
    with pytest.raises(HiCacheConfigError, match="hicache.guard"):
        env.install()
    env.uninstall()


def test_a_pool_that_cannot_be_registered_is_tried_once_not_on_every_copy(hicache, make_pool, standins, monkeypatch):
    """Finding 8: the failure is logged and counted once; later copies pass straight through."""
    from dsv4_idxk_probe.sglang import hicache as adapter

    env = hicache()
    env.allow_probe_errors = True

    def unreadable(pool):
        raise ValueError("a pool this probe cannot read")

    monkeypatch.setattr(adapter, "pool_geometry", unreadable)
    before = safety.error_counts()
    pool = make_pool("fp8_indexer")
    for _ in range(3):
        assert _copy_round_trip(pool)
    after = safety.error_counts()
    grown_by = {site: after[site] - before.get(site, 0) for site in after if after[site] != before.get(site, 0)}
    assert grown_by == {"hicache.pool_init": 1}
    assert id(pool) in env.probe.unusable


def test_the_copies_of_a_pool_that_cannot_be_registered_count_unverified_probe_error(hicache, make_pool, standins,
                                                                                     monkeypatch):
    """Its copies pass straight through, and its bytes are counted as moved unverified, not left out."""
    from dsv4_idxk_probe.sglang import hicache as adapter

    env = hicache()
    env.allow_probe_errors = True
    monkeypatch.setattr(adapter, "pool_geometry", lambda pool: (_ for _ in ()).throw(ValueError("unreadable")))
    pool = make_pool("fp8_indexer")
    assert _copy_round_trip(pool)  # one page backed up over every layer, then loaded back layer by layer
    page_bytes = LAYERS * pool.item_bytes
    counted = {(dict(labels)["path"], dict(labels)["reason"]): value
               for labels, value in env.samples("coverage_bytes", outcome="unverified").items()}
    assert counted == {("hicache_backup", "probe_error"): page_bytes, ("hicache_load", "probe_error"): page_bytes}


def test_host_pool_records_are_read_by_diff_without_errors(hicache, make_pool, standins, tmp_path):
    """Found with SGLang's own servers: the pool's start-up record had no schema version,
    and `diff` counted every host-pool record of a prefill log as a bad line."""
    from dsv4_idxk_probe.offline.join import analyse
    from dsv4_idxk_probe.roomlog.lineformat import encode_line

    env = hicache()
    make_pool("fp8_indexer")
    assert any(r.get("event") == "pool" for r in env.records)
    log = tmp_path / "prefill-host.jsonl"
    log.write_bytes(b"".join(encode_line(r) for r in env.records))
    result = analyse([log])
    assert result.n_errors == 0, result.errors
