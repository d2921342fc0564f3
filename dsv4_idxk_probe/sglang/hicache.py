"""Hooks on SGLang's DeepSeek-V4 paged host pool (HiCache L2 copies).

Targets (configs/targets/sglang.yaml, "HiCache host pools"), all on
``sglang.srt.mem_cache.memory_pool_host.DeepSeekV4PagedHostPool`` and so
inherited by subclasses such as ``QSAIndexerPoolHost``:

* ``__init__``: register the pool (zero series, info metric, invariants);
* ``backup_from_device_all_layer``, ``load_to_device_per_layer``,
  ``backup_tokens_from_device_all_layer``: count and check each copy. The
  ``*_physical`` entry points call these through ``self`` and are not wrapped,
  and the token call that a backup makes internally is not counted again;
* ``set_from_flat_data_page``, ``get_page_buffer_meta``: host pages the storage
  tier writes; round-trip mode and restore verification forget their digests
  (a storage-tier page carries none: counted unverified, ``digest_lost``).

Each factory takes the probe runtime (``.metrics``, ``.config.hicache``,
``.emit``, ``.log``) and returns a wrapt wrapper. A wrapper bails out when the
probe is off, calls the original, and hands everything else to
dsv4_idxk_probe.hicache through `safe_invoke`; the only exception it raises
of its own is `GuardRefused` under ``hicache.guard: block``.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from ..hicache.geometry import DeviceBuffer, PoolGeometry, TokenRow
from ..hicache.probe import GuardRefused, HiCacheProbe, probe_for
from ..hicache.restore import EARLIER_SIDECAR_HEAD, SIDECAR_SUFFIX, is_index_k_pool, sidecar_bytes
from ..hicache.roundtrip import RowViews, page_rows
from ..safety import record_error, safe_invoke
from . import l3_files

#: The row that ``transfer_cache_dsv4_mla`` hard-codes (SGLang 0.5.23,
#: sgl_kernel/deepseek_v4/kvcacheio.cuh): 64-slot pages, 576 B value and 8 B
#: scale per slot, values first, 37440 B page stride.
DSV4_MLA_TOKEN_ROW = TokenRow(slots=64, value_bytes=576, scale_bytes=8, page_bytes=37440)

#: (io_backend, layout) pairs with a page copy in the pool; "*" is any layout.
PAGE_ROUTES = frozenset(
    {
        ("kernel", "layer_first"),
        ("kernel", "page_first"),
        ("direct", "layer_first"),
        ("direct", "page_first_direct"),
        ("kernel_ascend", "*"),
    }
)


# -- reading the pool -------------------------------------------------------------


def _buffer(tensor: torch.Tensor) -> DeviceBuffer:
    rows = tensor.shape[0] if tensor.dim() else 0
    row_bytes = tensor.numel() // rows * tensor.element_size() if rows else 0
    return DeviceBuffer(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), tensor.is_contiguous(), row_bytes)


def pool_geometry(pool: Any) -> PoolGeometry:
    """Plain facts about a DeepSeekV4PagedHostPool."""
    return PoolGeometry(
        name=str(pool.pool_name),
        layers=int(pool.layer_num),
        item_bytes=int(pool.item_bytes),
        page_size=int(pool.slot_page_size),
        host_pages=int(pool.num_host_pages),
        layout=str(pool.layout),
        # 0.5.18-0.5.19 have no such flag: their pools take every unaligned copy to the token path
        page_aligned_only=bool(getattr(pool, "page_aligned_only", False)),
        buffers=tuple(_buffer(b) for b in pool.device_buffers),
        page_routes=PAGE_ROUTES,
        token_row=DSV4_MLA_TOKEN_ROW,
    )


def pool_views(pool: Any) -> RowViews:
    """One layer of host or device rows as uint8 [rows, item_bytes].

    Holds the pool weakly: the probe must not keep a pool alive."""
    ref = weakref.ref(pool)

    def host_layer(layer: int) -> torch.Tensor:
        pool = ref()
        if pool.layout == "layer_first":
            return pool.kv_buffer[layer]
        if pool.layout == "page_first":
            return pool.kv_buffer[:, layer, :]
        return pool.kv_buffer[:, layer, 0, :]

    def device_layer(layer: int) -> torch.Tensor:
        buf = ref().device_buffers[layer]
        return buf.view(torch.uint8).reshape(buf.shape[0], -1)

    return RowViews(host_layer, device_layer)


def _state(probe: HiCacheProbe, pool: Any):
    """The pool's registration; a pool that cannot be registered is remembered, so its
    copies pass straight through instead of failing to register on every call."""
    state = probe.state_of(pool)
    if state is None and id(pool) not in probe.unusable:  # built before the probe was installed
        try:
            state = probe.register(pool, pool_geometry(pool), pool_views(pool))
        except Exception as exc:
            probe.unusable[id(pool)] = f"{type(exc).__name__}: {exc}"
            probe.log.warning("dsv4-idxk-probe hicache: pool %s not probed: %s", type(pool).__name__, probe.unusable[id(pool)])
            try:  # a pool made later at the same address is tried afresh
                weakref.finalize(pool, probe.unusable.pop, id(pool), None)
            except TypeError:
                pass  # not weak-referenceable: remembered for the process lifetime
            raise
    return state


# -- shared wrapper body --------------------------------------------------------------


def _begin(probe, pool, direction, pick, args, kwargs):
    host, device, io_backend, layer = pick(*args, **kwargs)
    if id(pool) in probe.unusable:
        _count_unprobed(probe, pool, direction, host, layer)
        return None
    state = probe.state_of(pool)
    if state is None:
        try:
            state = _state(probe, pool)
        except Exception:
            _count_unprobed(probe, pool, direction, host, layer)
            raise
    return probe.begin(state, direction, host, device, io_backend, layer)


def _count_unprobed(probe, pool, direction, host_indices, layer) -> None:
    """A copy of a pool the probe could not register: an index-K pool's bytes moved
    unverified (`probe_error`), from what the pool says of itself where it can."""
    try:
        layers = 1 if layer is not None else int(pool.layer_num)
        n = int(host_indices.numel()) if hasattr(host_indices, "numel") else len(host_indices)
        nbytes = n * layers * int(pool.item_bytes) // max(1, int(pool.slot_page_size))
        name = str(pool.pool_name)
    except Exception:
        return  # the pool says too little of itself to count (its failure is counted)
    probe.count_unprobed(name, "hicache_backup" if direction == "d2h" else "hicache_load", nbytes)


def _count_l3_unprobed(probe, pool, n_rows: int) -> None:
    """Host pages the storage tier filled in a pool the probe could not register: as a copy's."""
    if pool is not None and id(pool) in probe.unusable and n_rows:
        try:
            nbytes, name = int(n_rows) * int(pool.layer_num) * int(pool.item_bytes), str(pool.pool_name)
        except Exception:
            return
        probe.count_unprobed(name, "l3", nbytes)


def _around(probe: HiCacheProbe, site: str, call, wrapped, args, kwargs, outer: bool):
    """Refuse if the guard says so, run the original, account for it."""
    if call is not None and call.refusal is not None:
        raise GuardRefused(call.refusal)
    local = probe.local
    if outer:
        local.depth = getattr(local, "depth", 0) + 1
    ok = False
    try:
        result = wrapped(*args, **kwargs)
        ok = True
        return result
    finally:
        if outer:
            local.depth -= 1
        if call is not None:
            safe_invoke(site, probe.end, call, ok)


# -- factories ---------------------------------------------------------------------------


def make_backup_wrapper(runtime):
    """``backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)``."""
    probe = probe_for(runtime)

    def _pick(device_pool, host_indices, device_indices, io_backend, *_a, **_k):
        return host_indices, device_indices, io_backend, None

    def wrapper(wrapped, instance, args, kwargs):
        if not probe.active:
            return wrapped(*args, **kwargs)
        call = safe_invoke("hicache.backup", _begin, probe, instance, "d2h", _pick, args, kwargs)
        return _around(probe, "hicache.backup", call, wrapped, args, kwargs, outer=True)

    return wrapper


def make_load_wrapper(runtime):
    """``load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft)``."""
    probe = probe_for(runtime)

    def _pick(device_pool, host_indices, device_indices, layer_id, io_backend, *_a, **_k):
        return host_indices, device_indices, io_backend, layer_id

    def wrapper(wrapped, instance, args, kwargs):
        if not probe.active:
            return wrapped(*args, **kwargs)
        call = safe_invoke("hicache.load", _begin, probe, instance, "h2d", _pick, args, kwargs)
        return _around(probe, "hicache.load", call, wrapped, args, kwargs, outer=False)

    return wrapper


def make_backup_tokens_wrapper(runtime):
    """``backup_tokens_from_device_all_layer(host_indices, device_indices)``, when called
    directly (HiSparse decode); inside a wrapped backup it was counted already."""
    probe = probe_for(runtime)

    def _pick(host_indices, device_indices, *_a, **_k):
        return host_indices, device_indices, None, None

    def wrapper(wrapped, instance, args, kwargs):
        if not probe.active or getattr(probe.local, "depth", 0):
            return wrapped(*args, **kwargs)
        call = safe_invoke("hicache.backup_tokens", _begin, probe, instance, "d2h", _pick, args, kwargs)
        return _around(probe, "hicache.backup_tokens", call, wrapped, args, kwargs, outer=False)

    return wrapper


def make_pool_init_wrapper(runtime):
    """``__init__``: after construction, register the pool with the probe."""
    probe = probe_for(runtime)

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        if probe.active:
            safe_invoke("hicache.pool_init", _state, probe, instance)
        return result

    return wrapper


def _known_state(probe, pool):
    """The pool's registration, made now if the storage tier reaches it before any copy (a
    pool built before the probe was installed: its first touch may be a prefetch); None for
    a pool that cannot be registered (`_state` remembers it, and says why once)."""
    state = probe.state_of(pool)
    if state is None and id(pool) not in probe.unusable:
        try:
            state = _state(probe, pool)
        except Exception:
            return None
    return state


def _invalidate(probe, pool, rows) -> None:
    state = _known_state(probe, pool)
    if state is not None:
        probe.invalidate_rows(state, rows)


def _storage_wrote(probe, pool, rows) -> None:
    state = _known_state(probe, pool)
    if state is not None:
        probe.storage_wrote(state, rows)
    else:
        _count_l3_unprobed(probe, pool, len(rows))


def _follows_host_writes(probe) -> bool:
    """Whether anything keeps digests of host rows that a storage-tier write makes stale."""
    return probe.active and (probe.roundtrip is not None or probe.restore is not None)


def make_set_page_wrapper(runtime):
    """``set_from_flat_data_page(index, data_page)``: the storage tier wrote a host page.
    Inside a wrapped ``HiCacheFile._read_page`` the read itself tells restore verification
    whether the page came with its digests (`make_l3_read_wrapper`)."""
    probe = probe_for(runtime)

    def _rows(pool, index, *_a, **_k):
        return [int(index) // int(pool.slot_page_size)]

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        if _follows_host_writes(probe):
            rows = safe_invoke("hicache.set_page", _rows, instance, *args, **kwargs)
            if rows:
                reading = getattr(probe.local, "l3_read", 0) and probe.restore is not None
                # in a storage read: forget the row's digests now (counted by the read, which may
                # bring the page's own); elsewhere: forget them and count the page unverified
                safe_invoke("hicache.set_page", _invalidate if reading else _storage_wrote, probe, instance, rows)
        return result

    return wrapper


def make_page_meta_wrapper(runtime):
    """``get_page_buffer_meta(indices)``: hands host page addresses to the storage
    tier, which may write them (zero-copy prefetch): their kept digests are forgotten,
    unless a wrapped store call says it only reads them (`make_zero_copy_set_wrapper`)."""
    probe = probe_for(runtime)

    def _rows(pool, indices, *_a, **_k):
        return page_rows(indices, int(pool.slot_page_size))

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        if _follows_host_writes(probe) and getattr(probe.local, "zero_copy", None) != "set":
            rows = safe_invoke("hicache.page_meta", _rows, instance, *args, **kwargs)
            if rows:
                safe_invoke("hicache.page_meta", _invalidate, probe, instance, rows)
        return result

    return wrapper


# -- the storage tier (L3): digests travel beside the pages -----------------------------


def _sidecar_key(backend, pool_name, key) -> str:
    """The page's storage key as the backend forms it (``_log_key``), plus the sidecar suffix."""
    return f"{backend._log_key(pool_name, key)}{SIDECAR_SUFFIX}"


def _l3_state(probe, host_pool):
    state = _known_state(probe, host_pool)
    if state is None or probe.restore is None or not is_index_k_pool(state.geom.name):
        return None
    return state


def _l3_page_before(probe, backend, pool_name, key, host_pool, *_a, **_k):
    """Before ``_write_page`` or ``_read_page``: the index-K pool's state, the page's file,
    its version and the pool's fence generation (a read's digests are refused if a fence
    comes while it runs); None for other pools."""
    state = _l3_state(probe, host_pool)
    if state is None:
        return None
    generation = probe.restore.generation(state)
    path = l3_files.page_path(backend, pool_name, key)
    return state, path, l3_files.file_version(path), generation


_OTHER_BYTES_SAID: "weakref.WeakSet" = weakref.WeakSet()  # pool states whose L3 write check found other bytes
_OTHER_BYTES_LOCK = threading.Lock()  # several storage threads may find them at once


def _l3_wrote(probe, page_before, backend, pool_name, key, host_pool, page_offset, *_a, **_k) -> None:
    """After ``_write_page``: a page the backend stored anew takes its old sidecar away now and
    gets its own, in the collector's order, while it is still the page on disk, and only if
    that file holds this host row's bytes (another writer of the key, a DP rank, may have
    replaced it right after ``set`` did). Checked here, while SGLang's storage operation
    still holds the host row. A page that was there already (``set`` skips it) keeps
    whatever sidecar its own write left."""
    state, path, before, _generation = page_before
    if not l3_files.stored_anew(before, l3_files.file_version(path)):
        return
    sidecar = _sidecar_key(backend, pool_name, key)
    l3_files.remove_stored(backend, sidecar)
    if probe.restore.pool(state) is None:  # its rows are not digested: no sidecar to write
        return
    row = int(page_offset) // int(host_pool.slot_page_size)
    # what ``get_data_page(flat=True)`` gave ``set``: the row of each layer, layer after layer
    version = l3_files.holding(path, [layer[row] for layer in state.host_arrays()])
    if version is None:  # not this row's bytes on disk: no sidecar (its restore counts digest_lost)
        with _OTHER_BYTES_LOCK:
            said = state in _OTHER_BYTES_SAID
            _OTHER_BYTES_SAID.add(state)
        if not said:
            probe.log.warning(
                "dsv4-idxk-probe hicache pool %s: a page stored in L3 did not hold its host row's bytes right after "
                "the write (another process storing the same key, or a page layout the check does not know); such "
                "pages get no sidecar and their restores count unverified (digest_lost); said once per pool",
                state.geom.name)
        return

    def write(data) -> None:
        l3_files.write_while_current(backend, sidecar, path, version,
                                     lambda: l3_files.set_anew(backend, sidecar, torch.from_numpy(data)))

    probe.restore.write_sidecar(state, row, version, write)


def _l3_read(probe, page_before, backend, pool_name, key, host_pool, page_offset, *_a, **_k) -> None:
    """After ``_read_page``: the row gets the digests of the page's sidecar if that sidecar
    names the version of the page file the read found, before and after it (a page stored
    anew while it was read may have given the row either version's bytes)."""
    state, path, before, generation = page_before
    pool = probe.restore.pool(state)
    data = None
    if pool is not None:
        try:
            data = _read_sidecar(backend, _sidecar_key(backend, pool_name, key),
                                 sidecar_bytes(pool.layers, len(pool.layout.segments)))
        except Exception:  # e.g. a sidecar replaced between its stat and its read: the page counts as without
            record_error("hicache.l3_sidecar")
    row = int(page_offset) // int(host_pool.slot_page_size)
    version = l3_files.file_version(path)
    probe.restore.storage_read(state, row, data, version if version == before else None, generation)


def _l3_read_unprobed(probe, pool_name, key, host_pool, *_a, **_k) -> None:
    _count_l3_unprobed(probe, host_pool, 1)


def _read_sidecar(backend, sidecar: str, nbytes: int):
    """The sidecar's bytes, None when there is none of this size. A sidecar of the earlier
    format is taken away: ``get`` would refuse it (a short read) at every read of the page,
    and a page that stays stored gets no new one. One of any other size is left as it is
    (another probe's format, or a new one landing between the stat and the read)."""
    path = l3_files.stored_path(backend, sidecar)
    size = l3_files.stored_size(path)
    if size is None:
        return None
    if size != nbytes:
        if l3_files.head(path, len(EARLIER_SIDECAR_HEAD)) == EARLIER_SIDECAR_HEAD:
            l3_files.remove_stored(backend, sidecar)
        return None
    got = backend.get(sidecar, torch.empty(nbytes, dtype=torch.uint8))
    return None if got is None else got.numpy()


def make_l3_write_wrapper(runtime):
    """``HiCacheFile._write_page(pool_name, key, host_pool, page_offset)``: a host page was
    stored; its kept digests are stored beside it under a sidecar key (`_l3_wrote`)."""
    probe = probe_for(runtime)

    def wrapper(wrapped, instance, args, kwargs):
        if not probe.active or probe.restore is None:
            return wrapped(*args, **kwargs)
        before = safe_invoke("hicache.l3_write", _l3_page_before, probe, instance, *args, **kwargs)
        result = wrapped(*args, **kwargs)
        if result and before is not None:
            safe_invoke("hicache.l3_write", _l3_wrote, probe, before, instance, *args, **kwargs)
        return result

    return wrapper


def make_l3_read_wrapper(runtime):
    """``HiCacheFile._read_page(pool_name, key, host_pool, page_offset)``: a stored page was
    read into a host row; with its sidecar, the row keeps the digests its backup took."""
    probe = probe_for(runtime)

    def wrapper(wrapped, instance, args, kwargs):
        if not probe.active or probe.restore is None:
            return wrapped(*args, **kwargs)
        before = safe_invoke("hicache.l3_read", _l3_page_before, probe, instance, *args, **kwargs)
        local = probe.local
        local.l3_read = getattr(local, "l3_read", 0) + 1
        try:
            result = wrapped(*args, **kwargs)
        finally:
            local.l3_read -= 1
        if result and before is not None:
            safe_invoke("hicache.l3_read", _l3_read, probe, before, instance, *args, **kwargs)
        elif result:
            safe_invoke("hicache.l3_read", _l3_read_unprobed, probe, *args, **kwargs)
        return result

    return wrapper


# -- zero-copy storage backends (Mooncake, NIXL, UMBP): the host rows the store reads or fills


def _zero_copy_call(probe, mode: str, wrapped, args, kwargs):
    """Run a store call with `mode` ("get" or "set") told to the page-address hook."""
    local = probe.local
    before = getattr(local, "zero_copy", None)
    local.zero_copy = mode
    try:
        return wrapped(*args, **kwargs)
    finally:
        local.zero_copy = before


def _zero_copy_pool(backend, name):
    """The host pool a backend's ``batch_get_v2`` fills by address for pool `name`, else None.
    `HiCacheNixl` does so only for a pool it registered zero-copy (its context says; its bounce
    buffers reach the pool through ``set_from_flat_data_page``, counted by that hook);
    `MooncakeStore` and `UMBPStore` for every registered pool."""
    contexts = getattr(backend, "_hybrid_pool_ctx", None)
    if contexts is not None:
        context = contexts.get(name)
        return context.host_pool if context is not None and getattr(context, "is_zero_copy", False) else None
    return (getattr(backend, "registered_pools", None) or {}).get(name)


def _zero_copy_read(probe, backend, transfers, results) -> None:
    """After a zero-copy ``batch_get_v2``: each index-K page the store filled moved from L3
    without its digests (no sidecar travels with these backends): counted on `l3` as
    `unverified` (`digest_lost`), as its load will be on `hicache_load`. Pages the store
    missed moved nothing and count nothing."""
    for transfer in transfers or ():
        pool = _zero_copy_pool(backend, transfer.name)
        hits = results.get(transfer.name) if isinstance(results, dict) else None
        state = _l3_state(probe, pool) if pool is not None else None
        if state is None and hits and transfer.host_indices is not None:
            _count_l3_unprobed(probe, pool, sum(1 for hit in hits if hit))
        if state is None or not hits or not any(hits) or transfer.host_indices is None:
            continue
        if transfer.host_indices.numel() != len(hits) * state.geom.page_size:
            continue  # not a page per key: the store refused the transfer itself (NIXL), moving nothing
        rows = page_rows(transfer.host_indices, state.geom.page_size)
        read = [row for row, hit in zip(rows, hits) if hit]
        if read:
            probe.storage_wrote(state, read)


def make_zero_copy_get_wrapper(runtime):
    """``MooncakeStore.batch_get_v2(transfers, extra_info=None)`` (and `HiCacheNixl`'s,
    `UMBPStore`'s): the store writes host rows through the addresses
    ``get_page_buffer_meta`` gave it; the rows it filled are counted (`_zero_copy_read`)."""
    probe = probe_for(runtime)

    def _transfers(transfers, *_a, **_k):
        return transfers

    def wrapper(wrapped, instance, args, kwargs):
        if not _follows_host_writes(probe):
            return wrapped(*args, **kwargs)
        result = _zero_copy_call(probe, "get", wrapped, args, kwargs)
        if probe.restore is not None:
            safe_invoke("hicache.l3_zero_copy_get", _zero_copy_read, probe, instance, _transfers(*args, **kwargs),
                        result)
        return result

    return wrapper


def make_zero_copy_set_wrapper(runtime):
    """``MooncakeStore.batch_set_v2(transfers, extra_info=None)`` (and `HiCacheNixl`'s,
    `UMBPStore`'s): the store only reads the host rows it is handed, so their kept digests
    stay (the page-address hook is told)."""
    probe = probe_for(runtime)

    def wrapper(wrapped, instance, args, kwargs):
        if not _follows_host_writes(probe):
            return wrapped(*args, **kwargs)
        return _zero_copy_call(probe, "set", wrapped, args, kwargs)

    return wrapper
