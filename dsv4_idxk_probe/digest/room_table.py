"""What one launch digests: the rooms, and where each room's cells go.

Built on the host from sizes the host already knows (pages per room, tokens
per room), so the caller never reads a GPU tensor back. The physical page ids
stay where they are (a device tensor is read in place); the kernel reads them
through each room's page-table address and derives every row from the room
table, so the host does O(rooms) work, not O(rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .layout import RowLayout


# The room table the kernel reads, int64 [rooms, ROOM_COLUMNS]: page-table address,
# bytes per page id (4 or 8), pages, tokens, index of the room's first cell row.
ROOM_COLUMNS = 5


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
    # no page table found by an earlier submit (`PendingDigest.table`; not a field): a
    # batch of requests builds its room table from the pages (launch.py)
    table = None

    @property
    def n_pages(self) -> int:
        return len(self.pages)


def frozen_slots_per_page(layout: RowLayout, n_pages: int, n_tokens: int) -> np.ndarray:
    """Frozen slot count of each logical page (all full but possibly the last).
    Clamped in place with two ufuncs: `np.clip`'s Python wrapper costs the collector,
    which runs this once per room, more than the arithmetic."""
    starts = np.arange(n_pages, dtype=np.int64) * layout.page_tokens
    per_page = (n_tokens - starts) // layout.tokens_per_slot
    np.maximum(per_page, 0, out=per_page)
    np.minimum(per_page, layout.slots, out=per_page)
    return per_page.astype(np.int32)


@dataclass(frozen=True)
class CellPlan:
    """Where each room's cells sit in one launch's output: room after room, each a
    [layers, pages, segments] block of uint64 cell contributions."""

    first_cells: tuple[int, ...]  # per room: index of its first (layer, page) cell row
    page_counts: tuple[int, ...]
    n_layers: int
    n_cells: int  # (layer, page) cell rows in all
    max_pages: int

    def block(self, cells: np.ndarray, slot: int) -> np.ndarray:
        """Room `slot`'s cells as uint64 [layers, pages, segments] (a view)."""
        first, n_pages = self.first_cells[slot], self.page_counts[slot]
        return cells[first : first + self.n_layers * n_pages].reshape(self.n_layers, n_pages, cells.shape[1])


def plan_cells(rooms: Sequence[RoomRequest], n_layers: int) -> CellPlan:
    firsts, counts, total = [], [], 0
    for room in rooms:
        n = len(room.pages)
        firsts.append(total)
        counts.append(n)
        total += n_layers * n
    return CellPlan(tuple(firsts), tuple(counts), n_layers, total, max(counts, default=0))
