"""The HiCache targets applied by the probe's own patcher and runtime, as activation does."""

from __future__ import annotations

import pytest
import torch
import wrapt
from prometheus_client import CollectorRegistry

import sglang.srt.mem_cache.memory_pool_host as mph

from dsv4_idxk_probe.config import parse_config
from dsv4_idxk_probe.hicache import GuardRefused, forget, probe_for
from dsv4_idxk_probe.runtime import Runtime
from dsv4_idxk_probe.sglang.patcher import Patcher
from dsv4_idxk_probe.sglang.targets import load_target_file

from .conftest import page_indices


@pytest.fixture
def patched():
    """install -> yield -> remove, with the shipped target table's HiCache entries."""
    registry = CollectorRegistry()
    records = []
    config = parse_config({"hicache": {"guard": "block", "flush_interval_s": 3600}}, "<test>")
    runtime = Runtime(config, registry=registry, emit=records.append)
    targets = [t for t in load_target_file("sglang") if t.name.startswith("hicache.")]
    patcher = Patcher(runtime, targets, route="wrapt")
    runtime.patcher = patcher
    status = patcher.patch()
    yield runtime, registry, status, records
    patcher.unpatch()
    forget(runtime)
    runtime.close()
    assert not isinstance(mph.DeepSeekV4PagedHostPool.__dict__["backup_from_device_all_layer"], wrapt.FunctionWrapper)


def test_patched_counted_and_blocked_through_the_runtime(patched, make_pool, standins):
    runtime, registry, status, records = patched
    expected = {"hicache.pool_init", "hicache.backup", "hicache.load", "hicache.set_page", "hicache.page_meta",
                "hicache.l3_write_page", "hicache.l3_read_page", "hicache.l3_zero_copy_get", "hicache.l3_zero_copy_set",
                "hicache.l3_nixl_get", "hicache.l3_nixl_set", "hicache.l3_umbp_get", "hicache.l3_umbp_set"}
    if hasattr(mph.DeepSeekV4PagedHostPool, "backup_tokens_from_device_all_layer"):  # SGLang 0.5.23+
        expected.add("hicache.backup_tokens")
    assert {name: s for name, (s, _) in status.items()} == dict.fromkeys(expected, "patched")
    pool = make_pool("fp8_indexer")
    pool.backup_from_device_all_layer(None, page_indices([0]), page_indices([1]), "kernel")
    assert torch.equal(pool.kv_buffer[0][0], pool.device_buffers[0][1])
    with pytest.raises(GuardRefused):  # the patcher lets the configured refusal through
        pool.backup_from_device_all_layer(None, torch.arange(10, 20), torch.arange(0, 10), "kernel")
    assert "transfer_cache_dsv4_mla" not in standins.calls
    probe_for(runtime).publish()  # the flusher's job, done now
    samples = {
        s.labels["branch"]: s.value
        for family in registry.collect()
        for s in family.samples
        if s.name == "dsv4_idxk_probe_hicache_copies_total" and s.labels["pool"] == pool.pool_name
        and s.labels["direction"] == "d2h" and s.labels["io_backend"] == "kernel"
    }
    assert samples["page"] == 1 and samples["token_dsv4_mla"] == 1
    assert any(r.get("kind") == "hicache" and r.get("event") == "guard" for r in records)
