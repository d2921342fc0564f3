"""The storage tier (L3) on SGLang's real file backend (`HiCacheFile`, CPU): a stored index-K
page carries its backup digests beside it under a sidecar key, so a page restored from storage
is verified at its load; a page whose sidecar is gone is counted unverified (`digest_lost`)."""

from __future__ import annotations

import os

import pytest

from dsv4_idxk_probe.hicache.restore import SIDECAR_SUFFIX

from .conftest import LAYERS, accepted
from .test_restore_pools import backup, findings, load, settle

POOL = "deepseek_v4_c4_indexer"
SCALE_AT = 64 * 128  # the scale segment of an fp8 row starts after 64 x 128 B of payload


@pytest.fixture
def storage(tmp_path, monkeypatch):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    config = HiCacheStorageConfig(**accepted(  # the fields of the release under test
        HiCacheStorageConfig, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False, model_name="rig",
        extra_config={"file_storage_path": str(tmp_path / "l3")}))
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "l3"))  # releases read one or other
    backend = HiCacheFile(config, file_path=str(tmp_path / "l3"))
    if os.path.abspath(backend.file_path) != os.path.abspath(tmp_path / "l3"):
        pytest.fail(f"HiCacheFile stores elsewhere than the test's folder: {backend.file_path}")
    return backend


def page_file(backend, key: str) -> str:
    return os.path.join(backend.file_path, f"{backend._get_suffixed_key(backend._log_key(POOL, key))}.bin")


def store_evict_restore(pool, backend, between=None):
    """Host row 5 stored in L3 (with its sidecar), overwritten in the host pool (evicted and
    reused), `between` on the stored files, then read back from L3 into row 5."""
    offset = 5 * pool.slot_page_size
    assert backend._write_page(POOL, "page-5", pool, offset)
    for layer in range(LAYERS):
        pool.kv_buffer[layer][5].zero_()
    if between is not None:
        between()
    assert backend._read_page(POOL, "page-5", pool, offset)


def test_a_storage_tier_page_changed_in_storage_is_found_at_hicache_load(hicache, make_pool, storage):
    env = hicache()
    pool = make_pool("fp8_indexer")
    backup(pool)
    settle(env)  # the backup's digests are kept before the page is stored (the collector's order)
    path = page_file(storage, "page-5")

    def flip():  # one scale byte of layer 1 of the stored page
        settle(env)  # the sidecar is written by the collector, behind the backup's digests
        assert storage.exists(f"{storage._log_key(POOL, 'page-5')}{SIDECAR_SUFFIX}"), "no sidecar was stored"
        with open(path, "r+b") as f:
            f.seek(1 * pool.item_bytes + SCALE_AT + 3)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))

    store_evict_restore(pool, storage, flip)
    load(pool, device_rows=[0, 4])
    settle(env)
    (found,) = findings(env)
    assert [(c["pool_layer"], c["host_row"], c["device_page"], c["segment"]) for c in found["cells"]] == [
        (1, 5, 4, "scale")]
    row = LAYERS * pool.item_bytes
    assert env.value("coverage_bytes", path="l3", outcome="verified", reason="none") == row
    assert env.value("coverage_bytes", path="hicache_load", outcome="verified", reason="none") == 2 * row
    assert env.value("rooms_verified", stage="hicache_load", verdict="mismatch") == 1


def test_a_clean_storage_tier_round_trip_matches(hicache, make_pool, storage):
    env = hicache()
    pool = make_pool("fp8_indexer")
    backup(pool)
    settle(env)
    store_evict_restore(pool, storage, lambda: settle(env))
    load(pool)
    settle(env)
    assert findings(env) == []
    assert env.value("rooms_verified", stage="hicache_load", verdict="match") == 1
    assert env.value("coverage_bytes", path="l3", outcome="verified", reason="none") == LAYERS * pool.item_bytes


def test_a_page_whose_sidecar_was_lost_is_counted_unverified(hicache, make_pool, storage):
    env = hicache()
    pool = make_pool("fp8_indexer")
    backup(pool)
    settle(env)

    def lose_sidecar():
        settle(env)
        os.remove(page_file(storage, "page-5")[: -len(".bin")].replace(
            storage._get_suffixed_key(storage._log_key(POOL, "page-5")),
            storage._get_suffixed_key(f"{storage._log_key(POOL, 'page-5')}{SIDECAR_SUFFIX}")) + ".bin")

    store_evict_restore(pool, storage, lose_sidecar)
    load(pool)
    settle(env)
    assert findings(env) == []  # the restored row holds zeros no more, but nothing says what it should hold
    row = LAYERS * pool.item_bytes
    assert env.value("coverage_bytes", path="l3", outcome="unverified", reason="digest_lost") == row
    assert env.value("coverage_bytes", path="hicache_load", outcome="unverified", reason="digest_lost") == row
    assert env.value("rooms_verified", stage="hicache_load", verdict="unverified") == 1
