"""Inside the rig's servers: the rooms and the index-K pool, as the rig sees them.

What the hooks learn from SGLang's own objects (each room's pages, prefix,
token count and tokens; the indexer pool's buffers), shared by the injector
that changes those bytes and the oracle that checks them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...vocabulary import C4_RATIO as C4


def rid_of(req: Any) -> str:
    """SGLang's request id of `req`, as the plan names rooms."""
    return str(getattr(req, "rid", ""))


@dataclass
class Track:
    """One room on decode, as the rig sees it (from SGLang's own objects)."""

    rid: str
    rig_room: int | None
    room: int
    start: int  # decode prefix (page aligned)
    n_tokens: int  # transferred tokens
    pages: list[int]  # physical page of each logical page
    tokens: np.ndarray | None = None  # token ids by absolute position, known at commit
    before: dict[int, list[np.ndarray]] = field(default_factory=dict)  # logical page -> rows before the WRITE
    points: int = 0  # oracle points so far
    forwards: int = 0  # decode forwards run
    req_pool_idx: int | None = None
    released: bool = False  # SGLang freed its pages (a swap partner must still hold them)
    faults_done: set = field(default_factory=set)  # indices of its faults applied or refused here
    changed: set = field(default_factory=set)  # logical pages its faults changed
    waiting: set = field(default_factory=set)  # swap faults due, waiting for a partner room
    transfer: int = 0  # which transfer of the room this is (a retracted room is sent again)


@dataclass(frozen=True)
class LowRatioPool:
    """A V4.1 ratio-1 or ratio-2 index pool, as the stand-in writes it: one buffer per
    kv_source layer, rows of `slots` fp4 slots of `ratio` tokens, so full page p is rows
    p * rows_per_page .. p * rows_per_page + rows_per_page - 1."""

    ratio: int
    buffers: list[torch.Tensor]
    layer_ids: list[int]  # kv_source layer of each buffer (SGLang's sources_by_ratio)
    slots: int  # slots per row (SGLang's index page size)
    rows_per_page: int


class Rooms:
    """The rooms this server tracks and the index-K buffers their pages live in."""

    #: This server's Rooms, once the rig's hooks made it (the stand-in model asks which
    #: requests are the test's rooms, without importing the hooks that import it).
    live: "Rooms | None" = None

    def __init__(self):
        from ...digest import get_layout

        from .launch import INDEX_K_LAYOUT

        self.layout = get_layout(INDEX_K_LAYOUT)
        self.tracks: dict[int, Track] = {}  # bootstrap room -> Track (decode)
        self.by_pool_idx: dict[int, Track] = {}
        self.buffers: list[torch.Tensor] = []
        self.layer_ids: list[int] = []
        self.low_pools: list[LowRatioPool] = []  # V4.1 only: the oracle checks these too
        self.lock = threading.Lock()
        Rooms.live = self

    def bind_pool(self, pool: Any) -> None:
        if self.buffers:
            return
        pool = pool.get_kvcache() if hasattr(pool, "get_kvcache") else pool
        indexer = pool.index_pools[C4] if getattr(pool, "index_pools", None) else pool.c4_indexer_kv_pool
        self.buffers = list(indexer.index_k_with_scale_buffer)
        ratios = list(pool.compression_ratios)
        self.layer_ids = [layer for layer, ratio in enumerate(ratios) if ratio == C4]
        for ratio in (1, 2):
            low = (getattr(pool, "index_pools", None) or {}).get(ratio)
            if low is not None:
                slots = int(low.page_size)
                self.low_pools.append(LowRatioPool(
                    ratio, list(low.index_k_with_scale_buffer), [int(x) for x in pool.sources_by_ratio[ratio]],
                    slots, int(pool.page_size) // (ratio * slots)))

    def rows(self, page: int, layers: list[int] | None = None) -> list[np.ndarray]:
        idx = range(len(self.buffers)) if layers is None else layers
        return [self.buffers[i][page].numpy().copy() for i in idx]
