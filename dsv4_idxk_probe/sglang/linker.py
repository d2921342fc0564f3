"""Hooks on SGLang's direct external linker (``--enable-unified-cache-external-linker``:
Mooncake from 0.5.19, UMBP from 0.5.20).

In that mode index-K moves straight between device pages and the storage tier, with no
HiCache host pool between them: none of the host-pool hooks sees it, and no digest
travels with a stored page. Each load the linker queues into device pages is counted on
path ``l3``, ``unverified``, reason ``direct_linker``, with the index-K bytes of the pages
it loads (every index pool of the linker's pool group: the C4 pool, V4.1's low-ratio
pools, an fp4 pool's scales; never the indexer's compress state), so coverage says what
is not verified instead of nothing. Offloads (device to storage) are not counted: their
bytes are counted when a load brings them back.
"""

from __future__ import annotations

from typing import Any

from ..safety import safe_invoke

REASON = "direct_linker"


def make_direct_load_wrapper(runtime):
    """``MooncakeDirectLinker.load(rid, transfers)`` / ``UMBPDirectLinker.load``: True when
    SGLang queued the load (it runs at the next layer-wise loading)."""

    def wrapper(wrapped, instance, args, kwargs):
        queued = wrapped(*args, **kwargs)
        if queued is True and getattr(runtime, "metrics", None) is not None:
            safe_invoke("linker.load", _count_load, runtime, instance, _transfers(*args, **kwargs))
        return queued

    return wrapper


def _transfers(rid, transfers, *_args, **_kwargs):
    return transfers


def _count_load(runtime: Any, linker: Any, transfers: Any) -> None:
    nbytes = index_k_bytes(linker.pool_group, transfers)
    if nbytes:
        runtime.metrics.count_coverage("l3", "unverified", REASON, nbytes)


def is_index_k_entry(name: Any) -> bool:
    """SGLang's index-K pool names (``deepseek_v4_c{1,2,4}_indexer``, ``..._indexer_scale``),
    not the indexer's compress state (``..._indexer_state``)."""
    text = str(getattr(name, "value", name))
    return "_indexer" in text and not text.endswith("_state")


def index_k_bytes(group: Any, transfers: Any) -> int:
    """The index-K bytes a load of `transfers` writes: for each index pool of the linker's
    pool group, the pages of the transfer it takes its indices from (one storage key per
    page) times the pool's bytes per page over all its layer buffers (SGLang's own
    ``buffer_meta``: per buffer, address, row stride, bytes per page)."""
    by_name = {t.name: t for t in transfers}
    total = 0
    for name, source in group.sources.items():
        transfer = by_name.get(source)
        if not is_index_k_entry(name) or transfer is None or not transfer.keys:
            continue
        entry = group.entry_map[name]
        page_bytes = sum(int(meta[2]) for component in entry.buffer_meta for meta in component)
        total += len(transfer.keys) * page_bytes
    return total
