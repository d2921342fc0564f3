"""Flat work lists: which rows a launch digests, and where each result goes.

Built on the host from sizes the host already knows (pages per room, tokens
per room), so the caller never reads a GPU tensor back to build them. The
physical page ids stay on the device: the kernel reads them through each
room's page-table address.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .layout import RowLayout


@dataclass
class RoomRequest:
    """One room to digest.

    `pages[k]` is the physical page of logical page k (a 1-D int tensor on the
    buffers' device, or a sequence for host buffers). `n_tokens` counts the
    room's tokens from the start of logical page 0: it decides which slots
    of the last page are frozen.
    """

    key: str
    pages: Any
    n_tokens: int

    @property
    def n_pages(self) -> int:
        return len(self.pages)


def frozen_slots_per_page(layout: RowLayout, n_pages: int, n_tokens: int) -> np.ndarray:
    """Frozen slot count of each logical page (all full but possibly the last)."""
    starts = np.arange(n_pages, dtype=np.int64) * layout.page_tokens
    return np.clip((n_tokens - starts) // layout.tokens_per_slot, 0, layout.slots).astype(np.int32)


@dataclass
class WorkList:
    """Host-side tables for one launch.

    Output layout (uint64 words): every room's (layer, segment) block, room
    after room, then every room's page vector. Keeping the blocks adjacent
    lets one device op fold them into the room digests.
    """

    work: np.ndarray  # int32 [n_items, 4]: room slot, layer index, logical page, frozen slots
    ls_offsets: np.ndarray  # int64 [n_rooms]: start of each room's (layer, segment) block in `out`
    page_offsets: np.ndarray  # int64 [n_rooms]: start of each room's page vector in `out`
    ls_size: int  # uint64 words per (layer, segment) block
    out_size: int  # uint64 words of output


def build_worklist(layout: RowLayout, n_layers: int, rooms: Sequence[RoomRequest]) -> WorkList:
    """Room-major, then layer, then page; a handful of vector ops whatever the room count."""
    ls_size = n_layers * len(layout.segments)
    n_rooms = len(rooms)
    pages_per_room = np.fromiter((r.n_pages for r in rooms), dtype=np.int64, count=n_rooms)
    tokens = np.fromiter((r.n_tokens for r in rooms), dtype=np.int64, count=n_rooms)
    ls_offsets = np.arange(n_rooms, dtype=np.int64) * ls_size
    page_starts = np.cumsum(pages_per_room) - pages_per_room
    page_offsets = n_rooms * ls_size + page_starts

    items_per_room = pages_per_room * n_layers
    total = int(items_per_room.sum())
    room_of_item = np.repeat(np.arange(n_rooms, dtype=np.int64), items_per_room)
    k = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(items_per_room) - items_per_room, items_per_room)
    n_of_item = pages_per_room[room_of_item]
    page = k % np.maximum(n_of_item, 1)
    work = np.empty((total, 4), dtype=np.int32)
    work[:, 0] = room_of_item
    work[:, 1] = k // np.maximum(n_of_item, 1)
    work[:, 2] = page
    work[:, 3] = np.clip((tokens[room_of_item] - page * layout.page_tokens) // layout.tokens_per_slot, 0, layout.slots)
    return WorkList(work, ls_offsets, page_offsets, ls_size, n_rooms * ls_size + int(pages_per_room.sum()))
