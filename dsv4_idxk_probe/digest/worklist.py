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
    """Room-major, then layer, then page."""
    ls_size = n_layers * len(layout.segments)
    pages_per_room = np.array([r.n_pages for r in rooms], dtype=np.int64)
    ls_offsets = np.arange(len(rooms), dtype=np.int64) * ls_size
    page_offsets = len(rooms) * ls_size + np.concatenate(([0], np.cumsum(pages_per_room)[:-1])).astype(np.int64)

    chunks = []
    for slot, room in enumerate(rooms):
        n = room.n_pages
        if n == 0:
            continue
        frozen = frozen_slots_per_page(layout, n, room.n_tokens)
        chunk = np.empty((n_layers * n, 4), dtype=np.int32)
        chunk[:, 0] = slot
        chunk[:, 1] = np.repeat(np.arange(n_layers, dtype=np.int32), n)
        chunk[:, 2] = np.tile(np.arange(n, dtype=np.int32), n_layers)
        chunk[:, 3] = np.tile(frozen, n_layers)
        chunks.append(chunk)
    work = np.concatenate(chunks) if chunks else np.zeros((0, 4), dtype=np.int32)
    return WorkList(work, ls_offsets, page_offsets, ls_size, len(rooms) * ls_size + int(pages_per_room.sum()))
