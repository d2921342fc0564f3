"""The index pools beyond a side's C4 pool (DeepSeek-V4.1's ratio-1 and ratio-2 pools).

Why a monitor per pool: each pool has its own row layout (fp4, 64 slots of 1 or 2
tokens) and its own page addressing (k index pages per full page), while a digest
engine reads one layout. So every further readable pool gets its own engine and
monitor, fed the same rooms by `PrefillFanOut` / `DecodeFanOut`, which stand where
the side's monitor stood: the hooks (pd_prefill.py, pd_decode.py) call one monitor
and every pool sees the event.

* its records are ``kind: "index_pool"`` room records carrying ``pool`` (the ratio)
  and their own ``layout``; a mismatch's ``localisation`` carries ``pool`` too, and
  its ``pages`` are the pool's rows in room order (full page = row // k). The C4
  pool's records stay ``kind: "room"`` as before, so V4 logs read as they did;
* decode compares each pool through the exchange: the in-band slots hold the C4
  room digest alone, so prefill's table answers ``<room>/<attempt>@pool<ratio>``
  with that pool's digest (`PoolRoutedRooms`) and decode asks for it; without an
  exchange such a pool's verdicts are ``unverified``;
* a pool the probe cannot read (HIP split fp4, aiter page-8 order, a layout no
  entry describes) is logged once with its reason, and the bytes each room moves
  through it are counted ``coverage_bytes{path="pd", outcome="unverified",
  reason="layout_unknown"}`` on decode;
* enforce judges the C4 room digest only (the one the metadata row carries);
  no diagnosis (page journal) for the further pools.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np

from ..digest.engine import DigestEngine
from ..exchange.stages import StageEndpoints
from ..pd.coverage import skip_reason
from ..pd.decode import DecodeMonitor
from ..pd.prefill import PrefillMonitor, RecentRooms
from ..safety import safe_invoke
from .index_k import IndexPool, page_ids_of, room_pool_pages

log = logging.getLogger("dsv4_idxk_probe")

#: Record kind of a further index pool's room records (the C4 pool's stay "room").
POOL_RECORD_KIND = "index_pool"


def pool_key(key: str, ratio: int) -> str:
    """The exchange key of a room's digest of the index pool of `ratio`."""
    return f"{key}@pool{int(ratio)}"


def tagged_emit(emit: Callable[[dict], Any], pool: IndexPool) -> Callable[[dict], Any]:
    """`emit` for one further pool: its records name the pool, in the record and in
    the localisation of a mismatch."""
    ratio = int(pool.ratio)

    def emit_pool_record(record: dict) -> Any:
        record = {**record, "kind": POOL_RECORD_KIND, "pool": ratio}
        if isinstance(record.get("localisation"), dict):
            record["localisation"] = {**record["localisation"], "pool": ratio,
                                      "rows_per_page": pool.geometry.rows_per_page}
        return emit(record)

    return emit_pool_record


class PoolRoutedRooms:
    """Prefill's table of recent room digests, answering pool keys from each pool's table:
    the exchange server asks one table (the C4 monitor's) for every key.

    A PP stage holds only some layers, and SGLang makes a further pool only on the stages
    that hold its layers (V4.1 with PP 2: stage 0 may have no ratio-1 or ratio-2 pool). Decode
    asks every stage for each pool key and combines their answers; a stage holding none of
    a pool's layers answers a room it sent with an empty digest (no layers, `empty_digest`),
    which the combination leaves out (`combine_stage_digests`). Before, it answered "not
    found", and the pool was `unverified` on every room. `held`: the ratios of every further
    pool this stage has, read or not (a pool it has but cannot read is never called empty)."""

    def __init__(self, main: RecentRooms, pools: dict[int, RecentRooms], held: Sequence[int] = ()):
        self.main = main
        self.pools = pools
        self.held = frozenset(int(r) for r in (*held, *pools))
        self.capacity = main.capacity

    @property
    def evicted(self) -> int:
        return self.main.evicted + sum(t.evicted for t in self.pools.values())

    def get(self, key: str) -> Any:
        room, sep, pool = key.rpartition("@pool")
        if not sep:
            return self.main.get(key)
        if not pool.isdigit():
            return None
        ratio = int(pool)
        table = self.pools.get(ratio)
        if table is None:
            sent = self.main.get(room) if ratio not in self.held else None
            return empty_digest(sent, key) if sent is not None else None
        digest = table.get(room)
        # the client checks that the answer names the key it asked for
        return dataclasses.replace(digest, key=key) if digest is not None else None

    def __len__(self) -> int:
        return len(self.main)


def empty_digest(sent: Any, key: str) -> Any:
    """A room's digest of a pool this stage holds no layer of: no layers, the room's tokens and pages."""
    return dataclasses.replace(sent, key=key, layer_ids=(),
                               layer_segment=np.zeros((0, len(sent.segments)), dtype=np.uint64),
                               pages=np.zeros_like(sent.pages))


class PoolSide:
    """One further readable index pool of a side: its engine and monitor."""

    def __init__(self, pool: IndexPool, engine: DigestEngine, monitor: Any):
        self.pool = pool
        self.ratio = pool.ratio
        self.rows_per_page = pool.geometry.rows_per_page
        self.engine = engine
        self.monitor = monitor

    def pages(self, pages: Any) -> Any:
        return room_pool_pages(pages, self.rows_per_page)

    def close(self) -> None:
        self.engine.close()


def build_pool_sides(role: str, pools: Sequence[IndexPool], config: Any, emit: Callable[[dict], Any],
                     metrics: Any, fetch: Callable[[str], Any] | None = None) -> list[PoolSide]:
    """A `PoolSide` for every readable pool but the first (the C4 pool the side itself digests).
    `fetch(key)`: decode's exchange fetch (None: no exchange)."""
    built: list[PoolSide] = []
    try:
        for pool in pools[1:]:
            if not pool.readable:
                continue
            g = pool.geometry
            engine = DigestEngine.from_config(pool.layout, g.layer_ids, g.buffers, config, role=role)
            pool_emit = tagged_emit(emit, pool)
            if role == "prefill":
                monitor = PrefillMonitor(engine, pool_emit, metrics, table_size=config.exchange.table_size)
            else:
                monitor = DecodeMonitor(
                    engine, pool_emit, metrics,
                    fetch_vectors=partial(_fetch_pool, fetch, pool) if fetch is not None else None,
                    fetch_always=True,  # nothing in band: only the exchange carries these digests
                    step_interval=config.step_interval, max_rooms=config.exchange.table_size,
                )
            built.append(PoolSide(pool, engine, monitor))
    except BaseException:
        for side in built:
            side.close()
        raise
    return built


def _fetch_pool(fetch: Callable[[str, Any], Any], pool: IndexPool, key: str) -> Any:
    return fetch(pool_key(key, pool.ratio), pool.layout)


def fetch_pool_digest(assembly: Any, key: str, layout: Any) -> Any:
    """Decode's fetch of a pool key: asked of the endpoint remembered for its room. A PP
    prefill's stages (`StageEndpoints`) are remembered with the C4 pool's layout, which
    their digests of this pool are combined against: they take this pool's `layout`."""
    room_key = key.rpartition("@pool")[0] or key
    with assembly._lock:
        endpoint = assembly.peer_override or assembly._peers.get(room_key)
    if isinstance(endpoint, StageEndpoints):
        endpoint = StageEndpoints(endpoint, layout)
    return assembly.client.fetch(endpoint, key, retry_s=assembly._retry_s)


def unread_bytes_per_page(pools: Sequence[IndexPool]) -> int:
    """Index-K bytes per full page of the pools the probe cannot read."""
    return sum(p.bytes_per_page for p in pools if not p.readable)


def count_unread(metrics: Any, bytes_per_page: int, page_tokens: int, n_tokens: int,
                 reason: str = "layout_unknown", outcome: str = "unverified") -> None:
    """Count a room's bytes in unreadable pools as moved unverified (whole pages), or
    under `outcome` (a room skipped before it was received)."""
    if metrics is None or bytes_per_page <= 0 or n_tokens <= 0:
        return
    pages = -(-int(n_tokens) // max(1, int(page_tokens)))
    metrics.count_coverage("pd", outcome, reason, pages * bytes_per_page)


class PrefillFanOut:
    """Prefill's monitor for the hooks: the C4 monitor, and every further pool's after it.
    `stride`: entries per page of the tables the hooks pass (the C4 engine's
    `page_id_stride`); the further pools get page ids, made once per send."""

    def __init__(self, main: PrefillMonitor, pools: Sequence[PoolSide], stride: int = 1):
        self.main = main
        self.pools = list(pools)
        self.stride = int(stride)

    def room_sent(self, room: Any, pages: Any, n_tokens: int, extra: dict | None = None) -> Any:
        pending = self.main.room_sent(room, pages, n_tokens, extra)
        if self.pools:
            ids = page_ids_of(pages, self.stride)
            for pool in self.pools:
                safe_invoke("prefill.pool_send", pool.monitor.room_sent, room, pool.pages(ids), n_tokens, extra)
        return pending

    def rooms_sent(self, rooms: Sequence[tuple], extras: Sequence[dict | None] | None = None) -> Any:
        pending = self.main.rooms_sent(rooms, extras)
        if self.pools:
            ids = [(room, page_ids_of(pages, self.stride), n) for room, pages, n in rooms]
            for pool in self.pools:
                safe_invoke("prefill.pool_send", pool.monitor.rooms_sent,
                            [(room, pool.pages(pages), n) for room, pages, n in ids], extras)
        return pending

    def __getattr__(self, name: str) -> Any:
        return getattr(self.main, name)


class DecodeFanOut:
    """Decode's monitor for the hooks: the C4 monitor (whose results the hooks and
    enforce read), and every further pool's after it; unreadable pools counted."""

    def __init__(self, main: DecodeMonitor, pools: Sequence[PoolSide], metrics: Any = None,
                 unread_per_page: int = 0, page_tokens: int = 256):
        self.main = main
        self.pools = list(pools)
        self.metrics = metrics
        self.unread_per_page = unread_per_page
        self.page_tokens = page_tokens

    def room_received(self, room: Any, pages: Any, n_tokens: int, inband: Any, extra: dict | None = None) -> Any:
        pending = self.main.room_received(room, pages, n_tokens, inband, extra)
        for pool in self.pools:
            safe_invoke("decode.pool_received", pool.monitor.room_received, room, pool.pages(pages), n_tokens,
                        None, extra)
        if self.unread_per_page:
            safe_invoke("decode.pool_unread", count_unread, self.metrics, self.unread_per_page, self.page_tokens,
                        n_tokens)
        return pending

    def room_finished(self, room: Any) -> Any:
        pending = self.main.room_finished(room)
        for pool in self.pools:
            safe_invoke("decode.pool_finished", pool.monitor.room_finished, room)
        return pending

    def batch_done(self, finished: Sequence[Any], stepped: Sequence[tuple]) -> Any:
        pending = self.main.batch_done(finished, stepped)
        for pool in self.pools:
            safe_invoke("decode.pool_batch", pool.monitor.batch_done, finished, stepped)
        return pending

    def room_skipped(self, room: Any, reason: str, stage: str = "decode_recv", extra: dict | None = None,
                     n_tokens: int | None = None) -> None:
        """`n_tokens`: the room's length, for a room that was never received. The unreadable
        pools' bytes of such a room are counted here, `skipped` with the room's reason; a
        room the C4 monitor holds was received, and its receipt counted them (as every
        monitor uses a held room's own length, whatever the caller passed)."""
        never_received = bool(self.unread_per_page and n_tokens) and not self.main.holds(room)
        self.main.room_skipped(room, reason, stage=stage, extra=extra, n_tokens=n_tokens)
        for pool in self.pools:
            safe_invoke("decode.pool_skipped", pool.monitor.room_skipped, room, reason, stage=stage, extra=extra,
                        n_tokens=n_tokens)
        coverage_reason = skip_reason(reason) if never_received else None
        if coverage_reason is not None:
            safe_invoke("decode.pool_unread", count_unread, self.metrics, self.unread_per_page, self.page_tokens,
                        n_tokens, coverage_reason, "skipped")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.main, name)
