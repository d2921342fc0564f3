"""The storage tier (L3) on SGLang's real file backend (`HiCacheFile`, CPU): a stored index-K
page carries its backup digests beside it under a sidecar key, so a page restored from storage
is verified at its load; a page whose sidecar is gone is counted unverified (`digest_lost`)."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from dsv4_idxk_probe.hicache.restore import SIDECAR_SUFFIX, decode_sidecar, encode_sidecar
from dsv4_idxk_probe.sglang import l3_files

from .conftest import HAS_BACKUP_TOKENS, LAYERS, accepted, host_row
from .test_restore_pools import backup, findings, load, settle

POOL = "deepseek_v4_c4_indexer"
SCALE_AT = 64 * 128  # the scale segment of an fp8 row starts after 64 x 128 B of payload


def file_backend(tmp_path, monkeypatch, **extra):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    config = HiCacheStorageConfig(**accepted(  # the fields of the release under test
        HiCacheStorageConfig, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False, model_name="rig",
        extra_config={"file_storage_path": str(tmp_path / "l3"), **extra}))
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "l3"))  # releases read one or other
    backend = HiCacheFile(config, file_path=str(tmp_path / "l3"))
    if os.path.abspath(backend.file_path) != os.path.abspath(tmp_path / "l3"):
        pytest.fail(f"HiCacheFile stores elsewhere than the test's folder: {backend.file_path}")
    return backend


@pytest.fixture
def storage(tmp_path, monkeypatch):
    return file_backend(tmp_path, monkeypatch)


@pytest.fixture(params=["no metadata cache", "metadata cache"])
def storages(request, tmp_path, monkeypatch):
    """The file backend as shipped, and with its metadata cache (``exists`` answers from it)."""
    backend = file_backend(tmp_path, monkeypatch, enable_metadata_cache=request.param == "metadata cache",
                           metadata_ttl=60)
    assert (getattr(backend, "metadata_cache", None) is not None) == (request.param == "metadata cache")
    return backend


def page_file(backend, key: str) -> str:
    return os.path.join(backend.file_path, f"{backend._get_suffixed_key(backend._log_key(POOL, key))}.bin")


def corrupt_silently(path: str, offset: int, mask: int = 0x40) -> None:
    """One byte of a stored file changed as storage corrupts it: the bytes change, the file's
    metadata (inode, size, modification time) does not."""
    st, version = os.stat(path), l3_files.file_version(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert l3_files.file_version(path) == version


def backed_up(hicache, make_pool, layout: str = "layer_first", io_backend: str = "kernel"):
    """The probe installed and a pool's device pages backed up to its host rows (row 5 among
    them), their digests kept before anything is stored (the collector's order)."""
    env = hicache()
    pool = make_pool("fp8_indexer", layout)
    backup(pool, io_backend)
    settle(env)
    return env, pool


def store_evict_restore(pool, backend, between=None):
    """Host row 5 stored in L3 (with its sidecar), overwritten in the host pool (evicted and
    reused), `between` on the stored files, then read back from L3 into row 5."""
    offset = 5 * pool.slot_page_size
    assert backend._write_page(POOL, "page-5", pool, offset)
    for layer in range(LAYERS):
        host_row(pool, 5, layer).zero_()
    if between is not None:
        between()
    assert backend._read_page(POOL, "page-5", pool, offset)


def assert_load_verified(env, pool, io_backend="kernel"):
    """The restored row's load is compared with the digests its page carried: all match."""
    load(pool, io_backend)
    settle(env)
    assert findings(env) == []
    assert env.value("rooms_verified", stage="hicache_load", verdict="match") == 1
    assert env.value("coverage_bytes", path="l3", outcome="verified", reason="none") == LAYERS * pool.item_bytes


def assert_load_unverified(env, pool, load_rows=load):
    """The restored row came without digests: its load (`load_rows(pool)`) is counted
    unverified, never a finding."""
    load_rows(pool)
    settle(env)
    assert findings(env) == []
    row = LAYERS * pool.item_bytes
    assert env.value("coverage_bytes", path="l3", outcome="unverified", reason="digest_lost") == row
    assert env.value("coverage_bytes", path="hicache_load", outcome="unverified", reason="digest_lost") == row
    assert env.value("rooms_verified", stage="hicache_load", verdict="unverified") == 1


def test_a_storage_tier_page_changed_in_storage_is_found_at_hicache_load(hicache, make_pool, storage):
    env = hicache()
    pool = make_pool("fp8_indexer")
    backup(pool)
    settle(env)  # the backup's digests are kept before the page is stored (the collector's order)
    path = page_file(storage, "page-5")

    def flip():  # one scale byte of layer 1 of the stored page
        settle(env)  # the sidecar is written by the collector, behind the backup's digests
        assert storage.exists(f"{storage._log_key(POOL, 'page-5')}{SIDECAR_SUFFIX}"), "no sidecar was stored"
        corrupt_silently(path, 1 * pool.item_bytes + SCALE_AT + 3)

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


@pytest.mark.parametrize("layout, io_backend", [("layer_first", "kernel"), ("page_first", "kernel"),
                                                ("page_first_direct", "direct")])
def test_a_clean_storage_tier_round_trip_matches(hicache, make_pool, storage, layout, io_backend):
    """Each host layout SGLang has: the page's file holds the row's bytes in the order the
    write's check reads them (else no sidecar is stored, and the restore counts unverified)."""
    env, pool = backed_up(hicache, make_pool, layout, io_backend)
    store_evict_restore(pool, storage, lambda: settle(env))
    assert_load_verified(env, pool, io_backend)


def test_a_page_read_with_its_digests_counts_verified_only_once_a_load_compares_it(hicache, make_pool, storage):
    """A page read from L3 with its sidecar is verifiable, not yet verified: l3 counts it
    verified when a load compares it, and unverified (`digest_lost`) if its digests go
    first: here a backup over its host row before any load."""
    env, pool = backed_up(hicache, make_pool)
    store_evict_restore(pool, storage)
    settle(env)
    assert not env.value("coverage_bytes", path="l3", outcome="verified", reason="none")
    backup(pool)  # host rows 2 and 5 backed up again: row 5's L3 digests are replaced, never compared
    assert_read_page_never_compared(env, pool)
    assert env.value("coverage_bytes", path="hicache_load", outcome="verified", reason="none") == 2 * LAYERS * pool.item_bytes


def assert_read_page_never_compared(env, pool):
    """Host row 5 came from L3 with its digests, which went before a load compared them: the
    rows' load is no finding, and the page counts l3 unverified, never verified."""
    load(pool)
    settle(env)
    assert findings(env) == []
    assert not env.value("coverage_bytes", path="l3", outcome="verified", reason="none")
    assert env.value("coverage_bytes", path="l3", outcome="unverified", reason="digest_lost") == LAYERS * pool.item_bytes


@pytest.mark.skipif(not HAS_BACKUP_TOKENS, reason="backup_tokens_from_device_all_layer arrives in SGLang 0.5.23")
def test_a_token_backup_after_a_read_refuses_the_read_digests_still_on_their_way(hicache, make_pool, storage):
    """The read's digests reach the store on the collector; a token backup between (its
    fence) must refuse them, or the row would hold the stored page's digests over the token
    copy's bytes: the page counts l3 unverified and its load is no finding."""
    from .test_restore_pools import _hold_collector

    env, pool = backed_up(hicache, make_pool)
    held = []

    def hold():  # the sidecar written, the collector then held: the read's digests wait behind it
        settle(env)
        held.append(_hold_collector(env, pool))

    store_evict_restore(pool, storage, hold)
    before = host_row(pool, 5, 0).clone()
    # tokens 73-82: the token kernel's own row geometry (C4's, not this pool's) puts them in host row 5
    pool.backup_tokens_from_device_all_layer(torch.arange(73, 83), torch.arange(10))
    assert not torch.equal(host_row(pool, 5, 0), before)
    held[0].set()
    assert_read_page_never_compared(env, pool)


@pytest.mark.skipif(not HAS_BACKUP_TOKENS, reason="backup_tokens_from_device_all_layer arrives in SGLang 0.5.23")
def test_a_token_backup_while_a_page_is_read_refuses_the_page_s_digests(hicache, make_pool, storage, monkeypatch):
    """A token backup that writes into the row between the storage read's fill of it and the
    probe's look at the sidecar: its fence counts from before the read, so the page's digests
    are refused (else the row's next clean load would read as a mismatch nobody made)."""
    env, pool = backed_up(hicache, make_pool)
    get = storage.get

    def token_backup_then_get(key, *args, **kwargs):
        if str(key).endswith(SIDECAR_SUFFIX):  # the row is filled; the sidecar is being read
            pool.backup_tokens_from_device_all_layer(torch.arange(73, 83), torch.arange(10))  # into host row 5
        return get(key, *args, **kwargs)

    store_evict_restore(pool, storage, lambda: (settle(env), monkeypatch.setattr(storage, "get", token_backup_then_get)))
    assert_read_page_never_compared(env, pool)


def test_a_sidecar_whose_read_fails_leaves_its_page_counted_unverified(hicache, make_pool, storage, monkeypatch):
    """`get` of the sidecar raises (HiCacheFile's short read, when the sidecar is replaced
    between its size check and its read): the page counts as one without digests, never
    as nothing."""
    env, pool = backed_up(hicache, make_pool)
    env.allow_probe_errors = True
    get = storage.get

    def short_read(key, *args, **kwargs):
        if str(key).endswith(SIDECAR_SUFFIX):
            raise IOError("Short read")
        return get(key, *args, **kwargs)

    store_evict_restore(pool, storage, lambda: (settle(env), monkeypatch.setattr(storage, "get", short_read)))
    assert_load_unverified(env, pool)


def test_a_page_whose_sidecar_was_lost_is_counted_unverified(hicache, make_pool, storage):
    env, pool = backed_up(hicache, make_pool)

    def lose_sidecar():
        settle(env)
        os.remove(sidecar_file(storage, "page-5"))

    store_evict_restore(pool, storage, lose_sidecar)
    assert_load_unverified(env, pool)  # the restored row holds zeros no more, but nothing says what it should hold


def sidecar_file(backend, key: str) -> str:
    return l3_files.stored_path(backend, f"{backend._log_key(POOL, key)}{SIDECAR_SUFFIX}")


def evict(backend, path: str) -> None:
    """What the backend's evictor does to one file: unlink it, and tell the metadata cache."""
    os.remove(path)
    if getattr(backend, "metadata_cache", None) is not None:
        backend.metadata_cache.remove(os.path.basename(path)[: -len(".bin")])


def compute_anew(pool):
    """Device page 6 (host row 5's source) holds other bytes for the same tokens, as a
    kernel whose results depend on the batch gives; its backup keeps their digests."""
    for layer in range(LAYERS):
        pool.device_buffers[layer].view(torch.uint8)[6] ^= 0x5A
    backup(pool)


def stored_with_sidecar(hicache, make_pool, backend):
    """Host row 5 backed up and stored in L3 as page-5, its sidecar beside it."""
    env, pool = backed_up(hicache, make_pool)
    assert backend._write_page(POOL, "page-5", pool, 5 * pool.slot_page_size)
    settle(env)
    assert os.path.exists(sidecar_file(backend, "page-5")), "no sidecar was stored"
    return env, pool


def test_a_page_stored_again_after_its_file_was_evicted_is_compared_with_its_own_digests(
        hicache, make_pool, storages):
    """The evictor took page-5's file but not its sidecar; the same key's page, stored again
    with other bytes, must not be compared with the old sidecar's digests (found 2026-12-06:
    ``set`` skipped the new sidecar, and a clean restore read as a mismatch)."""
    env, pool = stored_with_sidecar(hicache, make_pool, storages)
    evict(storages, page_file(storages, "page-5"))
    compute_anew(pool)
    settle(env)
    store_evict_restore(pool, storages, lambda: settle(env))
    assert_load_verified(env, pool)


def test_a_page_the_backend_kept_gets_no_sidecar_of_other_bytes(hicache, make_pool, storage):
    """Page-5 is on disk and its sidecar was evicted; a later backup of other bytes under the
    same key is not stored (``set`` skips a key that exists), so its digests must not be
    written beside the old page: the page's restore is counted unverified, not a mismatch."""
    env, pool = stored_with_sidecar(hicache, make_pool, storage)
    evict(storage, sidecar_file(storage, "page-5"))
    compute_anew(pool)
    settle(env)

    def kept_as_it_was():
        settle(env)
        assert not os.path.exists(sidecar_file(storage, "page-5")), "a sidecar of other bytes was written"

    store_evict_restore(pool, storage, kept_as_it_was)
    assert_load_unverified(env, pool)


def dated_after(path: str, earlier) -> None:
    """Date a file stored again 5 ms after the version `earlier` of it, as a store that comes
    later does: this test is faster than the kernel's file clock (ticks of 1-10 ms), and
    on a file system that keeps no inode generation a reused inode number would leave the
    two versions alike (docs/hicache.md, "Known limits")."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, max(st.st_mtime_ns, earlier[3] + 5_000_000)))


def stored_page(backend, key: str, fill: int, later_than=None):
    value = torch.full((4096,), fill, dtype=torch.uint8)
    assert backend.set(backend._log_key(POOL, key), value)
    path = page_file(backend, key)
    if later_than is not None:
        dated_after(path, later_than)
    return path, l3_files.file_version(path)


def test_a_sidecar_is_written_only_while_its_page_is_the_one_on_disk(storages):
    sidecar = f"{storages._log_key(POOL, 'page-5')}{SIDECAR_SUFFIX}"

    writes = []

    def write_sidecar():
        writes.append(sidecar)
        assert storages.set(sidecar, torch.zeros(64, dtype=torch.uint8))

    path, version = stored_page(storages, "page-5", 1)
    assert l3_files.write_while_current(storages, sidecar, path, version, write_sidecar)
    assert storages.exists(sidecar)

    l3_files.remove_stored(storages, sidecar)
    assert not storages.exists(sidecar) and not os.path.exists(sidecar_file(storages, "page-5"))
    evict(storages, path)
    stored_page(storages, "page-5", 2, later_than=version)  # stored again before the old page's sidecar was written
    assert not l3_files.write_while_current(storages, sidecar, path, version, write_sidecar)
    assert not os.path.exists(sidecar_file(storages, "page-5"))
    assert len(writes) == 1, "a sidecar was written for a page no longer on disk"

    path, version = stored_page(storages, "page-6", 3)
    sidecar6 = f"{storages._log_key(POOL, 'page-6')}{SIDECAR_SUFFIX}"

    def stored_again_while_writing():  # the page's new version lands as its old one's sidecar is written
        evict(storages, path)
        stored_page(storages, "page-6", 4, later_than=version)
        assert storages.set(sidecar6, torch.zeros(64, dtype=torch.uint8))

    assert not l3_files.write_while_current(storages, sidecar6, path, version, stored_again_while_writing)
    assert not storages.exists(sidecar6), "the old page's sidecar stayed beside the new page"


def test_a_page_stored_anew_is_told_from_one_the_backend_skipped(storage):
    path = page_file(storage, "page-7")
    before = l3_files.file_version(path)
    assert before is None
    _, first = stored_page(storage, "page-7", 1)
    assert l3_files.stored_anew(before, first)
    _, skipped = stored_page(storage, "page-7", 2)  # the key exists: set skips it
    assert not l3_files.stored_anew(first, skipped)
    evict(storage, path)
    _, again = stored_page(storage, "page-7", 3, later_than=first)
    assert l3_files.stored_anew(first, again)


def test_a_page_stored_again_where_the_probe_did_not_see_it_is_counted_unverified(hicache, make_pool, storages):
    """The evictor took page-5's file, and the key was stored again with other bytes where the
    probe's hook did not run (the probe off then, or its pool not registered): the old sidecar
    stays beside a page it does not describe. Its restore is counted unverified, never compared
    with that sidecar's digests (a mismatch nobody made)."""
    env, pool = stored_with_sidecar(hicache, make_pool, storages)
    path = page_file(storages, "page-5")
    first = l3_files.file_version(path)
    evict(storages, path)
    compute_anew(pool)
    settle(env)
    offset = 5 * pool.slot_page_size
    assert storages.set(storages._log_key(POOL, "page-5"), pool.get_data_page(offset, flat=True))  # no hook around it
    dated_after(path, first)
    assert os.path.exists(sidecar_file(storages, "page-5")), "the old sidecar is the case under test"
    for layer in range(LAYERS):
        host_row(pool, 5, layer).zero_()
    assert storages._read_page(POOL, "page-5", pool, offset)
    assert_load_unverified(env, pool)


def test_a_page_another_writer_replaced_within_the_write_gets_no_sidecar(hicache, make_pool, storages, monkeypatch,
                                                                        caplog):
    """Two processes store one key in the same instant (attention-DP ranks share a model's MLA
    keys): both find it absent, both write, and the other's ``os.replace`` lands right after
    this one's. The file then holds the other's bytes (computed in another batch, one byte
    apart), so this row's digests must not be stored beside it."""
    env, pool = backed_up(hicache, make_pool)
    page_key, path = storages._log_key(POOL, "page-5"), page_file(storages, "page-5")
    real_set = storages.set

    def set_then_the_other_writer(key, value=None, *args, **kwargs):
        stored = real_set(key, value, *args, **kwargs)
        if key == page_key:
            other = value.clone().view(torch.uint8)
            other[1 * pool.item_bytes + SCALE_AT + 3] ^= 0x40
            other.numpy().tofile(f"{path}.other")
            os.replace(f"{path}.other", path)
        return stored

    monkeypatch.setattr(storages, "set", set_then_the_other_writer)
    with caplog.at_level(logging.WARNING, logger="dsv4_idxk_probe.hicache"):
        store_evict_restore(pool, storages, lambda: settle(env))
    assert not os.path.exists(sidecar_file(storages, "page-5")), "this row's digests went beside the other's bytes"
    assert_load_unverified(env, pool)
    assert any("did not hold its host row's bytes" in r.getMessage() for r in caplog.records), \
        "the operator is not told why the pool's L3 restores count unverified"


def test_a_page_rewritten_through_the_file_system_is_another_page(hicache, make_pool, storage):
    """A stored page changed by a write the file system dates (its modification time moves: a
    writer outside ``set``) is not the page its sidecar describes: its restore is counted
    unverified. Corruption that leaves the file's metadata as it was is found (the test above)."""
    env, pool = backed_up(hicache, make_pool)
    path = page_file(storage, "page-5")

    def rewrite():
        settle(env)
        written = l3_files.file_version(path)
        corrupt_silently(path, 1 * pool.item_bytes + SCALE_AT + 3)
        dated_after(path, written)  # then dated, as the file system dates a write, however coarse its clock

    store_evict_restore(pool, storage, rewrite)
    assert_load_unverified(env, pool)


def test_a_page_stored_anew_while_it_is_read_is_counted_unverified(hicache, make_pool, storage, monkeypatch):
    """Another version of page-5 lands, with a sidecar naming it, while SGLang reads the old one:
    the row holds bytes no sidecar on disk describes now, so its restore is counted unverified."""
    env, pool = stored_with_sidecar(hicache, make_pool, storage)
    path, sidecar_path, page_key = page_file(storage, "page-5"), sidecar_file(storage, "page-5"), \
        storage._log_key(POOL, "page-5")
    real_get = storage.get

    def get_then_stored_anew(key, *args, **kwargs):
        got = real_get(key, *args, **kwargs)
        if key == page_key:
            data = bytearray(open(path, "rb").read())
            data[SCALE_AT + 3] ^= 0x40
            with open(f"{path}.new", "wb") as f:
                f.write(data)
            os.replace(f"{path}.new", path)
            words = np.fromfile(sidecar_path, dtype=np.uint64)
            digests, _ = decode_sidecar(words.view(np.uint8), int(words[1]), int(words[2]))
            encode_sidecar(digests, l3_files.file_version(path)).tofile(sidecar_path)  # names the new version
        return got

    monkeypatch.setattr(storage, "get", get_then_stored_anew)
    for layer in range(LAYERS):
        host_row(pool, 5, layer).zero_()
    assert storage._read_page(POOL, "page-5", pool, 5 * pool.slot_page_size)
    assert_load_unverified(env, pool)


def test_a_sidecar_of_the_earlier_format_reads_as_none_and_is_taken_away(hicache, make_pool, storage):
    """A sidecar written before sidecars named their page's version (three header words, not
    seven: ``get`` would refuse it as a short read) is no sidecar: the restore counts
    unverified, the probe fails nowhere, and the old file goes."""
    env, pool = backed_up(hicache, make_pool)

    def earlier_format():
        settle(env)
        words = np.fromfile(sidecar_file(storage, "page-5"), dtype=np.uint64)
        np.concatenate([np.frombuffer(b"dsv4idxk", dtype=np.uint64), words[1:3], words[7:]]).tofile(
            sidecar_file(storage, "page-5"))

    store_evict_restore(pool, storage, earlier_format)
    assert not os.path.exists(sidecar_file(storage, "page-5"))
    assert_load_unverified(env, pool)  # and the fixture: no probe error counted


def test_a_sidecar_of_another_digest_version_reads_as_none(hicache, make_pool, storage):
    """Stored pages outlive the probe that stored them: a sidecar written by a probe of digest
    version 1 (magic "dsv4idx2", the same size) holds digests of another definition. It is no
    sidecar: the restore counts unverified, and no mismatch is found."""
    env, pool = backed_up(hicache, make_pool)

    def written_by_digest_version_1():
        settle(env)
        words = np.fromfile(sidecar_file(storage, "page-5"), dtype=np.uint64)
        words[0] = int.from_bytes(b"dsv4idx2", "little")
        words.tofile(sidecar_file(storage, "page-5"))

    store_evict_restore(pool, storage, written_by_digest_version_1)
    assert_load_unverified(env, pool)  # and the fixture: no probe error counted


def test_a_file_stored_again_on_a_reused_inode_is_another_version(storage):
    """ext4 hands a freed inode number out again at once, and the kernel's file clock moves in
    ticks: the inode's generation tells the two files apart where their number, size and
    time are alike."""
    path, first = stored_page(storage, "page-8", 1)
    evict(storage, path)
    _, again = stored_page(storage, "page-8", 2)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, first[3]))  # the same tick
    again = l3_files.file_version(path)
    if st.st_ino != first[0]:
        pytest.skip(f"the file system gave the new file another inode number ({first[0]} -> {st.st_ino})")
    if not keeps_generations(path):
        pytest.skip("the file system keeps no inode generation (the other three decide)")
    assert again != first


def keeps_generations(path: str) -> bool:
    """Whether the file system answers FS_IOC_GETVERSION (asked here, not through the probe)."""
    import array
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, 0x80087601, array.array("l", [0]), True)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_a_metadata_cache_entry_put_back_after_the_old_sidecar_went_does_not_stop_the_new_one(
        hicache, make_pool, tmp_path, monkeypatch):
    """With SGLang's metadata cache, an ``exists`` that saw the old sidecar just before the
    probe removed it puts the cache's entry back; the new sidecar's ``set`` must not be
    skipped for that (the page's restores would count unverified for the cache's TTL)."""
    backend = file_backend(tmp_path, monkeypatch, enable_metadata_cache=True, metadata_ttl=60)
    env, pool = stored_with_sidecar(hicache, make_pool, backend)
    evict(backend, page_file(backend, "page-5"))
    compute_anew(pool)
    settle(env)
    removed = l3_files.remove_stored

    def removed_then_seen(backend_, storage_key):  # a concurrent exists() landed just before the unlink
        removed(backend_, storage_key)
        backend_.metadata_cache.add(backend_._get_suffixed_key(storage_key))

    monkeypatch.setattr(l3_files, "remove_stored", removed_then_seen)
    store_evict_restore(pool, backend, lambda: settle(env))
    assert os.path.exists(sidecar_file(backend, "page-5")), "the new sidecar's set was skipped"
    assert_load_verified(env, pool)


def test_a_sidecar_of_another_size_is_no_sidecar_and_stays(hicache, make_pool, storage):
    """A file under the sidecar key that is neither this format nor the earlier one (another
    probe's, or a new sidecar landing as it is read) is not used, and not taken away."""
    env, pool = backed_up(hicache, make_pool)

    def another_size():
        settle(env)
        np.arange(40, dtype=np.uint64).tofile(sidecar_file(storage, "page-5"))

    store_evict_restore(pool, storage, another_size)
    assert os.path.exists(sidecar_file(storage, "page-5"))
    assert_load_unverified(env, pool)


def test_a_file_system_without_inode_generations_still_versions_files(storage, monkeypatch):
    """Where FS_IOC_GETVERSION is not answered (overlayfs, tmpfs), the generation reads 0 and
    inode, size and time tell versions apart; nothing fails."""
    import errno

    def unanswered(*_args, **_kwargs):
        raise OSError(errno.ENOTTY, "Inappropriate ioctl for device")

    monkeypatch.setattr(l3_files.fcntl, "ioctl", unanswered)
    path, first = stored_page(storage, "page-9", 1)
    assert first is not None and first[1] == 0 and first[2] == 4096
    evict(storage, path)
    _, again = stored_page(storage, "page-9", 2, later_than=first)
    assert again[1] == 0 and again != first
    assert l3_files.holding(path, [np.full(4096, 2, dtype=np.uint8)]) == again
    assert l3_files.holding(path, [np.full(4096, 1, dtype=np.uint8)]) is None


def test_a_page_read_into_a_pool_no_copy_registered_yet_is_counted_on_l3(hicache, make_pool, storage):
    """A pool built before the probe was installed, first touched by a storage-tier read (a
    page an earlier run stored): the pool registers at that read, as at a copy. Before, the
    read counted nothing on `l3` (found by review)."""
    pool = make_pool("fp8_indexer")  # built before the probe is installed
    offset = 5 * pool.slot_page_size
    assert storage._write_page(POOL, "page-5", pool, offset)  # no probe: no sidecar
    env = hicache()
    assert storage._read_page(POOL, "page-5", pool, offset)
    settle(env)
    assert env.samples("coverage_bytes", path="l3") == {
        (("outcome", "unverified"), ("reason", "digest_lost")): LAYERS * pool.item_bytes}


def test_a_page_read_into_a_pool_that_cannot_be_registered_is_counted_on_l3(hicache, make_pool, storage,
                                                                             monkeypatch):
    from dsv4_idxk_probe.sglang import hicache as adapter

    pool = make_pool("fp8_indexer")
    offset = 5 * pool.slot_page_size
    assert storage._write_page(POOL, "page-5", pool, offset)
    env = hicache()

    def broken(_pool):
        raise ValueError("a pool the probe cannot read")

    monkeypatch.setattr(adapter, "pool_geometry", broken)
    assert storage._read_page(POOL, "page-5", pool, offset)
    settle(env)
    assert env.samples("coverage_bytes", path="l3") == {
        (("outcome", "unverified"), ("reason", "probe_error")): LAYERS * pool.item_bytes}


def test_a_page_read_into_a_pool_whose_rows_are_not_digested_says_why(hicache, make_pool, storage, monkeypatch):
    """Its copies count `layout_unknown`; its storage-tier pages counted `digest_lost`, as if
    a digest had been kept and lost (found by review)."""
    from dsv4_idxk_probe.hicache import restore as restore_module

    monkeypatch.setattr(restore_module.RestoreVerifier, "_make", lambda self, state: None)
    env = hicache()
    pool = make_pool("fp8_indexer")
    backup(pool)
    offset = 5 * pool.slot_page_size
    assert storage._write_page(POOL, "page-5", pool, offset)
    assert storage._read_page(POOL, "page-5", pool, offset)
    pool.set_from_flat_data_page(offset, pool.get_data_page(offset, flat=True))  # another backend's read
    settle(env)
    assert env.samples("coverage_bytes", path="l3") == {
        (("outcome", "unverified"), ("reason", "layout_unknown")): 2 * LAYERS * pool.item_bytes}
