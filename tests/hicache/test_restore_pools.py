"""Restore verification on SGLang's real DeepSeek-V4 host pools (CPU): the device
pages a load wrote are compared with what their backup read, with round-trip mode off."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from .conftest import HAS_BACKUP_TOKENS, LAYERS, SUPPORTED, host_row, page_indices

HOST_ROWS, DEVICE_ROWS = [2, 5], [1, 6]
STAGE = "hicache_load"


def backup(pool, io_backend="kernel"):
    pool.backup_from_device_all_layer(None, page_indices(HOST_ROWS), page_indices(DEVICE_ROWS), io_backend)


def load(pool, io_backend="kernel", device_rows=DEVICE_ROWS, layers=None):
    """Restore HOST_ROWS into `device_rows`, pages that held something else, one call per layer
    in `layers`' order (the pool's layers ascending, as SGLang loads DeepSeek-V4's)."""
    host, dev = page_indices(HOST_ROWS), page_indices(device_rows)
    for l in range(pool.layer_num):
        pool.device_buffers[l].view(torch.uint8)[device_rows] = 0  # the pages held something else
    for l in range(pool.layer_num) if layers is None else layers:
        pool.load_to_device_per_layer(None, host, dev, l, io_backend)


def settle(env):
    assert env.probe.restore.drain(), "the restore digests were not delivered"


def restore_engine(env, pool):
    """The pool's restore digest engine: every backup's and load's digest is its submit."""
    return env.probe.restore._pools[env.probe.state_of(pool).key].snapshot


def submit_fails(*args, **kwargs):
    """A digest submit that raises, as one with no staging buffer does."""
    raise RuntimeError("no staging buffer")


def findings(env):
    return [r for r in env.records if r.get("event") == "restore_mismatch"]


@pytest.mark.parametrize("layout,io_backend", SUPPORTED)
def test_a_host_row_changed_before_its_load_is_found_at_hicache_load(hicache, make_pool, layout, io_backend):
    env = hicache()  # defaults: restore verification on, round trip off
    assert env.probe.roundtrip is None
    pool = make_pool("fp8_indexer", layout)
    backup(pool, io_backend)
    host_row(pool, 5, 1)[64 * 128 + 8] ^= 0x10  # a scale byte of host row 5, layer 1
    load(pool, io_backend, device_rows=[3, 7])
    settle(env)
    (found,) = findings(env)
    assert found["stage"] == STAGE and found["pool"] == "deepseek_v4_c4_indexer" and found["layout"] == "fp8"
    assert [(c["pool_layer"], c["host_row"], c["device_page"], c["segment"]) for c in found["cells"]] == [
        (1, 5, 7, "scale")]
    assert found["mismatch_rows"] == [5] and found["rows"] == 2
    assert env.value("rooms_verified", stage=STAGE, verdict="mismatch") == 1
    assert env.value("mismatch_cells", stage=STAGE, segment="scale") == 1
    assert env.value("mismatch_cells", stage=STAGE, segment="payload") == 0
    row = LAYERS * pool.item_bytes
    assert env.value("coverage_bytes", path="hicache_load", outcome="verified", reason="none") == 2 * row
    assert env.value("coverage_bytes", path="hicache_backup", outcome="verified", reason="none") == 2 * row


def test_copies_made_under_inference_mode_are_verified_and_a_changed_row_is_found(hicache, make_pool):
    """SGLang's scheduler may run under `torch.inference_mode` (SGLANG_ENABLE_TORCH_INFERENCE_MODE):
    its index tensors keep no version counter. Their rows are copied at the copy instead, so
    the backup and the load are verified, and a host row changed between them is found."""
    env = hicache()
    pool = make_pool("fp8_indexer")
    with torch.inference_mode():
        backup(pool)
        host_row(pool, 5, 1)[64 * 128 + 8] ^= 0x10
        load(pool, device_rows=[3, 7])
    settle(env)
    (found,) = findings(env)
    assert found["mismatch_rows"] == [5] and [c["device_page"] for c in found["cells"]] == [7]
    row = LAYERS * pool.item_bytes
    assert env.value("coverage_bytes", path="hicache_backup", outcome="verified", reason="none") == 2 * row
    assert env.value("coverage_bytes", path="hicache_load", outcome="verified", reason="none") == 2 * row


def test_clean_backups_and_loads_match_and_count_every_byte_verified(hicache, make_pool):
    env = hicache()
    pool = make_pool("fp8_indexer")
    backup(pool)
    load(pool, device_rows=[0, 4])
    load(pool, device_rows=[1, 6])
    settle(env)
    assert findings(env) == []
    assert env.value("rooms_verified", stage=STAGE, verdict="match") == 2
    assert env.value("rooms_verified", stage=STAGE, verdict="mismatch") == 0
    row = LAYERS * pool.item_bytes
    assert env.value("coverage_bytes", path="hicache_load", outcome="verified", reason="none") == 4 * row
    assert env.value("coverage_bytes", path="hicache_load", outcome="unverified", reason="digest_lost") is None


def test_a_faulty_load_copy_is_found_too(hicache, make_pool, monkeypatch):
    import sglang.srt.mem_cache.memory_pool_host as mph

    env = hicache()
    pool = make_pool("fp8_indexer")
    good = mph.transfer_kv_per_layer_mla

    def faulty(**kwargs):  # the load of layer 0 writes one payload byte wrong
        good(**kwargs)
        if kwargs["dst"] is pool.device_buffers[0]:
            kwargs["dst"].view(torch.uint8)[kwargs["dst_indices"][0]][5] ^= 1

    monkeypatch.setattr(mph, "transfer_kv_per_layer_mla", faulty)
    backup(pool)
    load(pool)
    settle(env)
    (found,) = findings(env)
    assert [(c["pool_layer"], c["host_row"], c["device_page"], c["segment"]) for c in found["cells"]] == [
        (0, 2, 1, "payload")]


def test_a_storage_tier_write_loses_the_digest_and_is_counted_unverified(hicache, make_pool):
    env = hicache()
    pool = make_pool("fp8_indexer", "page_first")
    backup(pool)
    other = torch.randint(0, 256, (LAYERS * pool.item_bytes,), dtype=torch.uint8)
    pool.set_from_flat_data_page(5 * pool.slot_page_size, other)  # L3 fills host row 5
    load(pool)
    settle(env)
    assert findings(env) == []  # no false alarm: the row's backup digest was dropped
    row = LAYERS * pool.item_bytes
    assert env.value("coverage_bytes", path="l3", outcome="unverified", reason="digest_lost") == row
    assert env.value("coverage_bytes", path="hicache_load", outcome="unverified", reason="digest_lost") == row
    assert env.value("coverage_bytes", path="hicache_load", outcome="verified", reason="none") == row
    assert env.value("rooms_verified", stage=STAGE, verdict="unverified") == 1


@pytest.mark.skipif(not HAS_BACKUP_TOKENS, reason="backup_tokens_from_device_all_layer arrives in SGLang 0.5.23")
def test_a_token_backup_over_a_backed_up_row_leaves_no_stale_digest(hicache, make_pool):
    """A token-granular backup writes parts of host rows whose page backup's digests are
    kept; a page load of such a row must not be compared with them (a mismatch nobody
    made): counted unverified, `digest_lost`, like a row the storage tier wrote."""
    env = hicache()
    pool = make_pool("fp8_indexer")
    host, dev = page_indices([0, 5]), page_indices(DEVICE_ROWS)
    pool.backup_from_device_all_layer(None, host, dev, "kernel")  # host rows 0, 5: digests kept
    settle(env)
    before = host_row(pool, 0, 0).clone()
    # tokens 0-9: the token kernel's own row geometry (not this pool's) puts them in host row 0
    pool.backup_tokens_from_device_all_layer(torch.arange(10), torch.arange(10))
    assert not torch.equal(host_row(pool, 0, 0), before)  # the token copy did write into row 0
    for layer in range(LAYERS):
        pool.load_to_device_per_layer(None, host, page_indices([3, 7]), layer, "kernel")
    settle(env)
    assert findings(env) == []
    row = LAYERS * pool.item_bytes
    assert env.value("coverage_bytes", path="hicache_load", outcome="unverified", reason="digest_lost") == 2 * row
    assert not env.value("coverage_bytes", path="hicache_load", outcome="verified", reason="none")
    assert env.value("rooms_verified", stage=STAGE, verdict="mismatch") == 0


def test_a_load_whose_digest_cannot_be_launched_is_counted_unverified(hicache, make_pool, monkeypatch):
    """The load's pages are not digested (its submit raises): counted `probe_error`, as a
    backup's failed submit is, never left out of the coverage."""
    env = hicache()
    env.allow_probe_errors = True
    pool = make_pool("fp8_indexer")
    backup(pool)
    settle(env)
    monkeypatch.setattr(restore_engine(env, pool), "submit", submit_fails)
    load(pool)
    settle(env)
    row = LAYERS * pool.item_bytes
    assert env.value("coverage_bytes", path="hicache_load", outcome="unverified", reason="probe_error") == 2 * row
    assert not env.value("coverage_bytes", path="hicache_load", outcome="verified", reason="none")


def test_evicted_digests_are_counted_and_their_loads_unverified(hicache, make_pool):
    env = hicache(restore_max_pages=1)
    pool = make_pool("fp8_indexer")
    backup(pool)  # two host rows, one kept
    load(pool)
    settle(env)
    assert env.value("records_dropped", sink="hicache_restore") == 1
    assert env.value("rooms_verified", stage=STAGE, verdict="unverified") == 1
    assert findings(env) == []


def test_a_backup_whose_digest_cannot_be_taken_forgets_what_its_rows_held(hicache, make_pool, monkeypatch):
    """Host rows backed up again hold new bytes; if that backup's digest cannot be taken (its
    submit raises), the rows' digests of their former bytes must go with them, or a clean
    load of the new bytes reads as a restore mismatch. The backup is counted unverified."""
    env = hicache()
    env.allow_probe_errors = True
    pool = make_pool("fp8_indexer")
    backup(pool)  # host rows 2, 5 <- device pages 1, 6: digests kept
    settle(env)
    with monkeypatch.context() as patch:
        patch.setattr(restore_engine(env, pool), "submit", submit_fails)
        pool.backup_from_device_all_layer(None, page_indices(HOST_ROWS), page_indices([3, 7]), "kernel")
    load(pool, device_rows=[0, 4])  # a good restore of what the host rows hold now
    settle(env)
    assert findings(env) == []
    row = LAYERS * pool.item_bytes
    assert env.value("coverage_bytes", path="hicache_backup", outcome="unverified", reason="probe_error") == 2 * row


def test_a_pool_collected_takes_its_restore_engine_with_it(hicache, make_pool):
    """A host pool garbage-collected leaves no restore set-up behind: one kept under its
    address (`id`) would be handed to a pool made later at the same address, and digest the
    old pool's device buffers there (a corrupt restore read as `match`)."""
    import gc
    import weakref

    env = hicache()
    pool = make_pool("fp8_indexer")
    backup(pool)
    settle(env)
    key = env.probe.state_of(pool).key
    engine = env.probe.restore._pools[key].engine
    gone = weakref.ref(pool)
    del pool
    gc.collect()
    assert gone() is None
    env.probe.flush()  # what the flusher does each interval (a copy's look-up of a pool does it too)
    assert key not in env.probe.restore._pools
    engine._tickets.put(None)  # closed already: a second stop is harmless
    deadline = time.monotonic() + 10
    while engine._thread is not None and engine._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine._thread is None or not engine._thread.is_alive()


def test_a_pool_collected_while_its_thread_holds_the_store_s_lock_does_not_deadlock(hicache, make_pool):
    """The cyclic collector runs a dead pool's finalizer at whatever allocation comes next, on
    that thread: here inside the digest store's `put`, which allocates under the store's
    lock. A finalizer that forgot the pool's digests there took that lock again and waited
    for itself (and SGLang's copying thread after it); it only queues the pool now."""
    import gc

    env = hicache()
    store = env.probe.restore.store
    pool = make_pool("fp8_indexer")
    backup(pool)
    settle(env)
    key = env.probe.state_of(pool).key
    pool.cycle = pool  # only the cyclic collector frees it
    del pool
    put = store.put

    def put_collecting(*args, **kwargs):
        with store._lock:  # as `put` holds it while it allocates: the collection lands here
            gc.collect()
        return put(*args, **kwargs)

    store.put = put_collecting
    done = threading.Event()
    worker = threading.Thread(target=lambda: (store.put(key, [0], np.zeros((LAYERS, 1, 2), np.uint64)), done.set()),
                              daemon=True)
    worker.start()
    assert done.wait(10), "the thread holding the store's lock waited for it again"
    store.put = put
    env.probe.flush()
    assert key not in env.probe.restore._pools  # retired all the same, by the flusher


def test_host_rows_a_pd_host_receive_fills_lose_their_digests_and_their_load_is_no_finding(hicache, make_pool):
    """Decode's host receive: prefill writes a room into host rows through the transfer engine,
    which no wrapped copy sees. The digests those rows kept from an earlier backup (a
    retraction's, a write-through's) no longer say what they hold: they go when decode
    publishes the rows (`_send_kv_metadata`, destination HOST), and the rows' restore counts
    `digest_lost`, never a finding."""
    from types import SimpleNamespace

    from dsv4_idxk_probe.sglang import pd_decode

    env = hicache()
    env.runtime.sides = {}  # no PD side in this process: its HiCache probe acts alone
    pool = make_pool("fp8_indexer")
    backup(pool)  # rows 2 and 5 keep their digests
    settle(env)
    host = SimpleNamespace(name="HOST", value="host")  # KVTransferDestination.HOST
    pd_decode.on_send_metadata(env.runtime, SimpleNamespace(scheduler=None), SimpleNamespace(req=None),
                               page_indices([5]), 256, {"decode_prefix_len": 0, "destination": host})
    for layer in range(LAYERS):
        host_row(pool, 5, layer).add_(1)  # the room prefill wrote there
    load(pool)
    settle(env)
    assert findings(env) == []
    row = LAYERS * pool.item_bytes
    assert env.value("coverage_bytes", path="hicache_load", outcome="verified", reason="none") == row  # row 2
    assert env.value("coverage_bytes", path="hicache_load", outcome="unverified", reason="digest_lost") == row


def test_restore_verification_off_digests_nothing(hicache, make_pool):
    env = hicache(restore_verify=False)
    pool = make_pool("fp8_indexer")
    backup(pool)
    host_row(pool, 5, 1)[0] ^= 1
    load(pool)
    assert env.probe.restore is None and findings(env) == []
    assert env.value("rooms_verified", stage=STAGE, verdict="mismatch") is None


def test_a_pool_that_is_not_index_k_is_not_digested(hicache, make_pool):
    env = hicache()
    pool = make_pool("c4_kv")
    backup(pool)
    load(pool)
    settle(env)
    assert env.probe.restore.pool(env.probe.state_of(pool)) is None
    assert env.value("coverage_bytes", path="hicache_load", outcome="verified", reason="none") is None


def _hold_collector(env, pool):
    """Keep the pool's restore collector busy until the returned event is set."""
    import threading

    release = threading.Event()
    state = env.probe.state_of(pool)
    env.probe.restore.pool(state).engine.post(lambda _arg: release.wait(10))
    return release


def test_on_the_cpu_the_pages_are_taken_at_the_copy_and_digested_on_the_collector(hicache, make_pool):
    env = hicache()
    pool = make_pool("fp8_indexer")
    backup(pool)  # registers the pool and its engine
    settle(env)
    release = _hold_collector(env, pool)
    backup(pool)
    for l in range(LAYERS):  # the forward overwrites the pages the backup read, before the collector gets to them
        pool.device_buffers[l].view(torch.uint8)[DEVICE_ROWS] ^= 0x5A
    state = env.probe.state_of(pool)
    assert env.probe.restore.pool(state).snapshot.pending_bytes > 0  # the pages wait as a copy
    release.set()
    load(pool, device_rows=[0, 4])
    settle(env)
    assert findings(env) == []  # the kept digests are those of the bytes the backup copied
    assert env.value("rooms_verified", stage=STAGE, verdict="match") == 1


def test_on_the_cpu_page_copies_past_their_bound_are_counted_queue_full(hicache, make_pool):
    env = hicache()
    pool = make_pool("fp8_indexer")
    backup(pool)
    settle(env)
    state = env.probe.state_of(pool)
    snapshot = env.probe.restore.pool(state).snapshot
    snapshot.max_bytes = 1  # one copy is always let through; a second waits for none
    release = _hold_collector(env, pool)
    backup(pool)
    backup(pool)
    release.set()
    settle(env)
    row = LAYERS * pool.item_bytes
    env.probe.publish()
    assert env.value("coverage_bytes", path="hicache_backup", outcome="unverified", reason="queue_full") == 2 * row
    assert snapshot.pending_bytes == 0


def test_a_collector_far_behind_is_posted_nothing_more_and_keeps_no_stale_digest(hicache, make_pool):
    """Backups refused for a full queue each post their rows' drop to the collector; with the
    collector stuck, those notes would grow without bound. Past twice the queue's bound the
    pool's digests are forgotten on the copying thread instead, fenced: a backup admitted
    before the fence and stored after it keeps nothing (its rows were copied over since)."""
    env = hicache(restore_queue_max=2)
    pool = make_pool("fp8_indexer")
    backup(pool)
    settle(env)
    engine = env.probe.restore.pool(env.probe.state_of(pool)).engine
    release = _hold_collector(env, pool)
    for _ in range(50):
        backup(pool)
    assert engine.backlog() <= 2 * 2 + 1
    release.set()
    settle(env)
    key = env.probe.state_of(pool).key
    assert env.probe.restore.store.get(key, HOST_ROWS) == [None, None]
    load(pool)
    settle(env)
    assert findings(env) == []
    assert env.value("rooms_verified", stage=STAGE, verdict="unverified") == 1  # digest_lost, counted


def _kernel_path_engine(layout, layer_ids, buffers, queue_max, **per_pool):
    """The restore engine as a GPU pool gets it (the Triton kernel; here under the interpreter,
    on the CPU pool's device layers), so the copying thread takes the GPU path: the token
    indices handed to the kernel as they are (`page_id_stride`), no page copy."""
    from dsv4_idxk_probe.digest import DigestEngine

    # `per_pool`: what `RestoreVerifier` sets, `restore.engine_options` included
    return DigestEngine(layout, layer_ids, buffers, backend="triton", max_pending=queue_max, **per_pool)


def test_on_the_kernel_path_the_token_indices_are_read_as_they_are_and_the_changed_row_is_found(
        hicache, make_pool):
    """End to end on the GPU pools' path: the kernel finds each page from every page-size-th
    device index itself; a host row changed before its load is found at the right cells,
    and the clean row matches."""
    env = hicache()
    env.probe.restore._engine_factory = _kernel_path_engine
    pool = make_pool("fp8_indexer")
    backup(pool)
    settle(env)
    restore = env.probe.restore.pool(env.probe.state_of(pool))
    assert restore.snapshot is None and restore.strided and restore.engine.page_id_stride == restore.page_size > 1
    host_row(pool, 2, 0)[17] ^= 0x01  # a payload byte of host row 2, layer 0
    load(pool, device_rows=[4, 3])
    settle(env)
    (found,) = findings(env)
    assert [(c["pool_layer"], c["host_row"], c["device_page"], c["segment"]) for c in found["cells"]] == [
        (0, 2, 4, "payload")]
    assert found["mismatch_rows"] == [2] and found["rows"] == 2
    load(pool, device_rows=[0, 6])  # host row 2 is loaded as it now is: it differs from its backup again
    host_row(pool, 2, 0)[17] ^= 0x01  # restored: the next load matches
    load(pool, device_rows=[5, 1])
    settle(env)
    assert env.value("rooms_verified", stage=STAGE, verdict="mismatch") == 2
    assert env.value("rooms_verified", stage=STAGE, verdict="match") == 1
