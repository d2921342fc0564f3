"""Page-group index checks: device-side counts, flushed by the flusher thread."""

from __future__ import annotations

import time

import pytest
import torch

from dsv4_idxk_probe.hicache import CHECK_LABELS, IndexChecker

from .conftest import HOST_PAGES, PAGE, page_indices


def violations(env, pool, direction="d2h"):
    return {
        check: env.value("hicache_index_violations", pool=pool, direction=direction, check=check)
        for check in CHECK_LABELS
    }


def test_straddling_group_is_counted_and_the_pool_really_drops_a_page(hicache, make_pool, standins):
    env = hicache()
    pool = make_pool("fp8_indexer")
    straddle = torch.arange(3 * PAGE + PAGE // 2, 4 * PAGE + PAGE // 2)  # half of page 3, half of page 4
    pool.backup_from_device_all_layer(None, page_indices([2]), straddle, "kernel")
    # SGLang floors the group to device page 3 and copies it whole; page 4 is never copied
    assert torch.equal(pool.kv_buffer[0][2], pool.device_buffers[0][3])
    assert violations(env, pool.pool_name) == dict.fromkeys(CHECK_LABELS, 0.0)  # not flushed yet
    env.probe.checker.flush()
    counts = violations(env, pool.pool_name)
    assert counts["device_unaligned"] == 1
    assert sum(counts.values()) == 1
    (record,) = [r for r in env.records if r.get("event") == "index_violations"]
    assert record["pool"] == pool.pool_name and record["counts"] == {"device_unaligned": 1}


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_each_check_in_its_column(hicache, make_pool, standins, io_backend):
    env = hicache()
    pool = make_pool("fp8_indexer")
    shuffled = page_indices([1]).flip(0)  # one whole page, out of order: first index is not the page start
    gapped = page_indices([5]).clone()
    gapped[7] = gapped[8]  # aligned first index, but not one whole page
    outside = page_indices([HOST_PAGES])  # past the last host page
    calls = [(page_indices([0]), shuffled), (page_indices([1]), gapped), (outside, page_indices([2]))]
    for host, dev in calls:
        try:
            pool.backup_from_device_all_layer(None, host, dev, io_backend)
        except Exception:
            pass  # the direct backend raises on the out-of-range row; the check still counts it
    env.probe.checker.flush()
    counts = violations(env, pool.pool_name)
    assert counts == {
        "host_not_whole_page": 0, "host_unaligned": 0, "host_out_of_range": 1,
        "device_not_whole_page": 2, "device_unaligned": 1, "device_out_of_range": 0,
    }  # fmt: skip


def test_clean_page_copies_count_nothing_and_loads_are_checked_once(hicache, make_pool, standins):
    env = hicache()
    pool = make_pool("fp4_indexer", "page_first")
    host, dev = page_indices([0, 1, 2]), page_indices([4, 5, 6])
    pool.backup_from_device_all_layer(None, host, dev, "kernel")
    for layer in range(pool.layer_num):
        pool.load_to_device_per_layer(None, host, dev, layer, "kernel")
    checker = env.probe.checker
    assert checker.pending() == 2  # one backup, and the per-layer loads of the same indices once
    checker.flush()
    assert sum(violations(env, pool.pool_name, "d2h").values()) == 0
    assert sum(violations(env, pool.pool_name, "h2d").values()) == 0


def test_one_readback_per_flush_however_many_calls(hicache, make_pool, standins):
    env = hicache()
    pools = [make_pool("fp8_indexer"), make_pool("c4_kv")]
    checker = env.probe.checker
    checker.flush()
    before = checker.readbacks
    for pool in pools:
        for i in range(5):
            pool.backup_from_device_all_layer(None, page_indices([i]), page_indices([i + 1]), "kernel")
    checker.flush()
    assert checker.readbacks - before == 1  # all on one device: one copy


def test_background_flusher_reports_without_being_asked(hicache, make_pool, standins):
    env = hicache(flush_interval_s=0.05)
    pool = make_pool("fp8_indexer")
    pool.backup_from_device_all_layer(None, page_indices([0]), page_indices([1]) + 1, "kernel")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not violations(env, pool.pool_name)["device_unaligned"]:
        time.sleep(0.02)
    assert violations(env, pool.pool_name)["device_unaligned"] == 1
    assert env.probe.flusher.alive


def test_full_queue_drops_and_counts():
    dropped, reports = [], []
    checker = IndexChecker(lambda slot, counts: reports.append(counts), dropped.append, queue_max=2)
    slot = checker.add_slot("p", "d2h", 4, 100, 100)
    bad = torch.tensor([1, 2, 3, 4])
    for _ in range(3):
        checker.submit(slot, bad, bad)
    assert dropped == [2]  # host and device index tensors of the third call
    checker.flush()
    assert reports == [{"host_unaligned": 2, "device_unaligned": 2}]


def test_cpu_indices_are_snapshotted_at_call_time():
    """Index buffers are reused by the caller (HiSparse slices persistent tables)."""
    reports = []
    checker = IndexChecker(lambda slot, counts: reports.append(counts), lambda n: None)
    slot = checker.add_slot("p", "h2d", 4, 100, 100)
    buf = torch.arange(8)
    checker.submit(slot, buf, buf)
    buf.add_(1)  # the caller rewrites its buffer before the flusher runs
    checker.flush()
    assert reports == []


def _tracking_checker():
    """A checker that tracks CPU tensors by version, as it tracks GPU ones."""
    reports, dropped = [], []
    checker = IndexChecker(lambda slot, counts: reports.append(counts), dropped.append, snapshot_cpu=False)
    return checker, checker.add_slot("p", "d2h", 4, 100, 100), reports, dropped


def test_tracked_indices_are_checked_when_untouched():
    checker, slot, reports, dropped = _tracking_checker()
    checker.submit(slot, torch.arange(8), torch.arange(1, 9))
    checker.submit(slot, torch.arange(8), torch.arange(1, 9))
    checker.flush()
    assert reports == [{"device_unaligned": 4}] and dropped == []


def test_inference_tensors_are_copied_at_the_call_and_checked():
    """Index tensors made under `torch.inference_mode` (SGLang's scheduler with
    SGLANG_ENABLE_TORCH_INFERENCE_MODE) keep no version counter to track them by: copied at
    the call, checked as any, and rewriting the caller's own afterwards changes nothing."""
    checker, slot, reports, dropped = _tracking_checker()
    with torch.inference_mode():
        host, device = torch.arange(8), torch.arange(1, 9)
        checker.submit(slot, host, device)
        device.sub_(1)  # the caller reuses its tensor: the check sees what the copy named
    checker.flush()
    assert reports == [{"device_unaligned": 2}] and dropped == []  # both page groups of 1..8


def test_tracked_indices_modified_before_the_check_are_dropped_not_reported():
    checker, slot, reports, dropped = _tracking_checker()
    table = torch.arange(16)
    view = table[:8]
    checker.submit(slot, view, view)
    table[:8] += 1  # the caller rewrites its table through another view of it
    checker.flush()
    assert reports == [] and dropped == [2]


def test_tracked_indices_modified_during_the_check_are_dropped_not_reported(monkeypatch):
    checker, slot, reports, dropped = _tracking_checker()
    table = torch.arange(8) + 1
    checker.submit(slot, table, table)
    check = checker._check

    def racing(device, batch):  # the owner writes while the flusher is checking
        out = check(device, batch)
        table.sub_(1)
        return out

    monkeypatch.setattr(checker, "_check", racing)
    checker.flush()
    assert reports == [] and sum(dropped) == 2  # both sides' results are discarded, not reported
