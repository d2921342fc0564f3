"""Round-trip mode on real pools: which leg broke a row, and where."""

from __future__ import annotations

import pytest
import torch

import sglang.srt.mem_cache.memory_pool_host as mph

from .conftest import LAYERS, SUPPORTED, host_row, page_indices

HOST_ROWS, DEVICE_ROWS = [2, 5], [1, 6]


def mismatches(env):
    return [r for r in env.records if r.get("event") == "roundtrip_mismatch"]


def backup_then_load(pool, io_backend, between=None, wipe=True):
    host, dev = page_indices(HOST_ROWS), page_indices(DEVICE_ROWS)
    pool.backup_from_device_all_layer(None, host, dev, io_backend)
    if between is not None:
        between()
    if wipe:
        for l in range(LAYERS):
            pool.device_buffers[l].view(torch.uint8)[DEVICE_ROWS] = 0
    for l in range(LAYERS):
        pool.load_to_device_per_layer(None, host, dev, l, io_backend)


@pytest.mark.parametrize("layout,io_backend", SUPPORTED)
def test_bit_flip_in_host_memory_names_pool_row_layer_and_leg(hicache, make_pool, standins, layout, io_backend):
    env = hicache(roundtrip=True)
    pool = make_pool("fp8_indexer", layout)

    def flip():
        host_row(pool, 5, 1)[1234] ^= 0x10

    backup_then_load(pool, io_backend, flip)
    (bad,) = mismatches(env)
    assert (bad["pool"], bad["host_row"], bad["layer"], bad["leg"]) == ("deepseek_v4_c4_indexer", 5, 1, "host")
    assert bad["device_row"] == 6 and bad["leg_name"] == "host memory while resident"
    name = pool.pool_name
    assert env.value("hicache_roundtrip", pool=name, leg="host", verdict="mismatch") == 1
    assert env.value("hicache_roundtrip", pool=name, leg="host", verdict="match") == len(HOST_ROWS) * LAYERS - 1
    assert env.value("hicache_roundtrip", pool=name, leg="d2h", verdict="match") == len(HOST_ROWS) * LAYERS
    # the flipped byte travels to the device, so the h2d copy itself is faithful
    assert env.value("hicache_roundtrip", pool=name, leg="h2d", verdict="mismatch") == 0


@pytest.mark.parametrize("op,leg", [("transfer_kv_all_layer_mla", "d2h"), ("transfer_kv_per_layer_mla", "h2d")])
def test_a_faulty_copy_is_blamed_on_its_leg(hicache, make_pool, standins, monkeypatch, op, leg):
    env = hicache(roundtrip=True)
    pool = make_pool("fp8_indexer")
    good = getattr(mph, op)
    faults = []

    def faulty(**kwargs):  # flips one bit of the first row written by its first call (layer 0)
        good(**kwargs)
        if not faults:
            target = kwargs["dst"] if "dst" in kwargs else pool.kv_buffer[0]
            target.view(torch.uint8)[kwargs["dst_indices"][0]][77] ^= 1
            faults.append(op)

    monkeypatch.setattr(mph, op, faulty)
    backup_then_load(pool, "kernel")
    legs = {(r["leg"], r["layer"]) for r in mismatches(env)}
    assert legs == {(leg, 0)}


def test_storage_write_into_a_host_page_forgets_its_digests(hicache, make_pool, standins):
    env = hicache(roundtrip=True)
    pool = make_pool("fp8_indexer", "page_first")
    other = torch.randint(0, 256, (LAYERS * pool.item_bytes,), dtype=torch.uint8)

    def l3_write():  # the storage tier fills host page 5 through the pool's own API
        pool.set_from_flat_data_page(5 * pool.slot_page_size, other)

    backup_then_load(pool, "kernel", l3_write)
    assert mismatches(env) == []
    assert env.value("hicache_roundtrip", pool=pool.pool_name, leg="host", verdict="unverified") == LAYERS
    assert env.value("hicache_roundtrip", pool=pool.pool_name, leg="h2d", verdict="match") == len(HOST_ROWS) * LAYERS


def test_the_same_write_behind_the_pools_back_is_reported(hicache, make_pool, standins):
    env = hicache(roundtrip=True)
    pool = make_pool("fp8_indexer", "page_first")
    other = torch.randint(0, 256, (LAYERS, pool.item_bytes), dtype=torch.uint8)

    def raw_write():
        pool.kv_buffer[5].copy_(other)

    backup_then_load(pool, "kernel", raw_write)
    assert {(r["host_row"], r["leg"]) for r in mismatches(env)} == {(5, "host")}


def test_roundtrip_off_reads_no_rows(hicache, make_pool, standins):
    env = hicache()
    pool = make_pool("fp8_indexer")
    backup_then_load(pool, "kernel", lambda: host_row(pool, 5, 1).__setitem__(3, 1 + int(host_row(pool, 5, 1)[3]) % 255))
    assert env.probe.roundtrip is None
    assert env.samples("hicache_roundtrip") == {}
    assert mismatches(env) == []


def test_pages_handed_to_storage_by_address_are_forgotten_too(hicache, make_pool, standins):
    """get_page_buffer_meta gives L3 raw addresses it may write (zero-copy prefetch)."""
    env = hicache(roundtrip=True)
    pool = make_pool("fp8_indexer", "layer_first")

    def l3_zero_copy_write():
        pool.get_page_buffer_meta(page_indices([5]))
        for l in range(LAYERS):
            pool.kv_buffer[l][5].fill_(7)

    backup_then_load(pool, "kernel", l3_zero_copy_write)
    assert mismatches(env) == []
    assert env.value("hicache_roundtrip", pool=pool.pool_name, leg="host", verdict="unverified") == LAYERS


@pytest.mark.parametrize("roundtrip", [False, True])
def test_backups_and_loads_are_page_journal_events_naming_the_host_row(hicache, make_pool, standins, roundtrip):
    """What a decode diagnosis shows beside a bad cell: the load into its page, from which
    host row, and (round-trip mode) whether that row matched at backup and while resident."""
    from dsv4_idxk_probe.diagnosis import PageJournal

    journal = PageJournal()
    hicache(roundtrip=roundtrip, journal=journal)
    pool = make_pool("fp8_indexer")

    def flip():  # host row 5, layer 0, while resident
        host_row(pool, 5, 0)[99] ^= 0x01

    backup_then_load(pool, "kernel", flip)
    events = journal.events_for(6)  # device row 6 <- host row 5
    assert [(e["event"], e["host_row"], e["pool"]) for e in events] == [
        ("hicache_backup", 5, "deepseek_v4_c4_indexer"), ("hicache_load", 5, "deepseek_v4_c4_indexer")]
    assert len(journal) == 2  # one event per backup, one per load (its first layer), whatever the layers
    if roundtrip:
        assert events[1]["host_row_checks"] == {"d2h": "match", "host": "mismatch", "h2d": "match", "layers": [0]}
        assert journal.events_for(1)[1]["host_row_checks"] == {"d2h": "match", "host": "match", "h2d": "match"}
    else:
        assert "host_row_checks" not in events[1]


def test_a_host_row_changed_while_resident_is_diagnosed_with_its_load_as_the_last_event(hicache, make_pool, standins):
    """Round trip plus the journal: a row changed in host memory at layer 1 (the load's journal
    event is recorded at layer 0) shows in that event's checks, and one roundtrip_diagnosis record
    names the host row, the device page it went to, that it matched at backup, and the load."""
    from dsv4_idxk_probe.diagnosis import PageJournal
    from dsv4_idxk_probe.hicache.culprit import describe

    journal = PageJournal()
    env = hicache(roundtrip=True, journal=journal)
    pool = make_pool("fp8_indexer")
    journal.record("hicache_load", [6], host_rows=[9], layer=0, detail={"pool": "deepseek_v4_c4"})  # another sub-pool
    backup_then_load(pool, "kernel", lambda: host_row(pool, 5, 1).__setitem__(4000, 1 + int(host_row(pool, 5, 1)[4000]) % 255))

    load = journal.events_for(6)[-1]
    assert (load["event"], load["host_row"]) == ("hicache_load", 5)
    assert load["host_row_checks"] == {"d2h": "match", "host": "mismatch", "h2d": "match", "layers": [1]}
    assert journal.events_for(1)[-1]["host_row_checks"] == {"d2h": "match", "host": "match", "h2d": "match"}
    (diag,) = [r for r in env.records if r.get("event") == "roundtrip_diagnosis"]
    assert (diag["pool"], diag["host_row"], diag["device_page"], diag["layer"]) == ("deepseek_v4_c4_indexer", 5, 6, 1)
    assert diag["leg"] == "host" and diag["checks"] == {"d2h": "match", "host": "mismatch", "h2d": "match"}
    assert [e["event"] for e in diag["events"]] == ["hicache_backup", "hicache_load"]
    assert diag["events"][-1]["host_row_checks"]["host"] == "mismatch"
    assert describe(diag) == ("deepseek_v4_c4_indexer host row 5 layer 1: changed in host memory while resident "
                              "(matched at backup); loaded into device page 6, last event hicache_load")


def test_a_faulty_backup_is_diagnosed_at_the_load_as_differing_at_backup(hicache, make_pool, standins, monkeypatch):
    from dsv4_idxk_probe.hicache.culprit import describe

    env = hicache(roundtrip=True)  # no journal (diagnosis off): the record still names the load's device page
    pool = make_pool("fp8_indexer")
    good = mph.transfer_kv_all_layer_mla

    def faulty(**kwargs):
        good(**kwargs)
        pool.kv_buffer[0].view(torch.uint8)[kwargs["dst_indices"][0]][77] ^= 1

    monkeypatch.setattr(mph, "transfer_kv_all_layer_mla", faulty)
    backup_then_load(pool, "kernel")
    (diag,) = [r for r in env.records if r.get("event") == "roundtrip_diagnosis"]
    assert (diag["host_row"], diag["device_page"], diag["layer"], diag["leg"]) == (2, 1, 0, "d2h")
    assert diag["events"] == []
    assert describe(diag) == ("deepseek_v4_c4_indexer host row 2 layer 0: the backup (device-to-host copy) wrote "
                              "different bytes; loaded into device page 1")
